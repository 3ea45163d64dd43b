"""The chat page in a real headless Chromium against the real gateway."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.app.harness import GatewayServer


def _open(page, gateway: GatewayServer, key: str) -> None:
    page.goto(f"{gateway.base}/#key={key}")
    expect(page.locator("#status")).to_have_text("connected", timeout=20_000)


def _ask(page, question: str, *, max_tokens: int, temperature: float = 0) -> None:
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", question)
    page.click("#send")


def test_answer_streams_in_and_stop_cancels_it_mid_answer(page, web_gateway: GatewayServer):
    _open(page, web_gateway, web_gateway.keys["local"])
    assert "#key=" not in page.url  # the key left the address bar
    _ask(page, "Once upon a time", max_tokens=480)

    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_class("msg assistant streaming", timeout=10_000)
    expect(page.locator("#stop")).to_be_visible()
    # Text arrives while the answer is still streaming ...
    page.wait_for_function(
        "() => { const a = document.querySelector('.msg.assistant.streaming .content');"
        " return a && a.textContent.trim().split(/\\s+/).length >= 3; }",
        timeout=20_000,
    )
    # ... and stop ends it mid-answer.
    page.click("#stop")
    meta = answer.locator(".meta")
    expect(meta).to_contain_text("stopped", timeout=10_000)
    expect(meta).to_contain_text("TTFT")
    tokens = int(meta.inner_text().split(" tokens")[0].split("·")[-1].strip())
    assert 1 <= tokens < 480
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()

    # A full answer shows TTFT and tokens/s; the conversation survives a reload.
    _ask(page, "Tom had a red ball", max_tokens=12)
    done = page.locator(".msg.assistant").last.locator(".meta")
    expect(done).to_contain_text("tokens/s", timeout=20_000)
    expect(done).to_contain_text("hit max tokens")
    page.reload()
    expect(page.locator("#status")).to_have_text("connected", timeout=20_000)
    expect(page.locator(".msg.user")).to_have_count(2)
    expect(page.locator("#conversations li")).to_have_count(1)
    assert page.js_errors == []


def test_unfinished_code_fence_renders_as_code(page, web_gateway: GatewayServer):
    _open(page, web_gateway, web_gateway.keys["local"])
    html = page.evaluate(
        "() => { const d = document.createElement('div');"
        " renderMarkdown(d, 'Here:\\n```python\\nprint(1)\\n'); return d.innerHTML; }"
    )
    assert "<pre>" in html and "print" in html
    sanitized = page.evaluate(
        "() => { const d = document.createElement('div');"
        " renderMarkdown(d, '<img src=x onerror=alert(1)>'); return d.innerHTML; }"
    )
    assert "onerror" not in sanitized


def test_wrong_key_shows_the_key_dialog(page, web_gateway: GatewayServer):
    page.goto(f"{web_gateway.base}/#key=cg_zzzzzzzz_wrong")
    expect(page.locator("#key-dialog")).to_be_visible(timeout=15_000)
    expect(page.locator("#key-error")).to_contain_text("refused")
    page.fill("#key-input", web_gateway.keys["local"])
    page.click("#key-form button[type=submit]")
    expect(page.locator("#status")).to_have_text("connected", timeout=15_000)
