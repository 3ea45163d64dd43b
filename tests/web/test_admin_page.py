"""The admin page in a real headless Chromium against the real gateway.

``chatgate serve`` on loopback prints an admin link with a session token in the URL
fragment; the page must take it, show the tenants with masked keys and quotas,
live usage against them after a real chat, and a usage chart.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

from playwright.sync_api import expect

from tenancy import Quotas
from tests.app.harness import ChatClient, GatewayServer

ADMIN_LINK_RE = re.compile(r"(http://127\.0\.0\.1:\d+/admin/)#token=(\S+)")


def _off_loop(fn, *args):
    # Playwright's sync API runs an event loop on this thread; asyncio.run needs another.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def _chat(gateway: GatewayServer, key: str) -> dict:
    async def go():
        client = await ChatClient.connect(gateway, key)
        try:
            return (await client.chat("a1", [{"role": "user", "content": "Once"}], temperature=0, max_tokens=8))[1]
        finally:
            await client.close()

    return asyncio.run(go())


def test_admin_page_shows_tenants_masked_keys_quotas_usage_and_chart(page, web_gateway: GatewayServer):
    match = ADMIN_LINK_RE.search(web_gateway.stdout_path.read_text())
    assert match, "serve printed no admin link"
    key = _off_loop(lambda: web_gateway.add_tenant(
        "pagecorp", quotas=Quotas(tokens_per_day=100_000, max_concurrent_chats=4)))
    done = _off_loop(_chat, web_gateway, key)
    assert done["type"] == "chat.done", done

    page.goto(f"{match.group(1)}#token={match.group(2)}")
    row = page.locator("#tenants tbody tr[data-tenant='pagecorp']")
    expect(row).to_be_visible(timeout=15_000)
    assert "#token=" not in page.url  # the token left the address bar
    prefix = key[:11]
    expect(row).to_contain_text(prefix + "_…")
    assert key not in page.content()  # only the masked key is ever shown
    used = done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
    expect(row).to_contain_text(f"{used:,} / 100,000")  # tokens today against the day budget
    expect(row).to_contain_text("0 / 4")  # nothing in flight against the concurrency limit

    page.select_option("#chart-tenant", "pagecorp")
    expect(page.locator("#chart")).to_have_attribute("data-tokens", str(used), timeout=10_000)
    expect(page.locator("#recent tbody tr")).to_have_count(1)
    expect(page.locator("#recent tbody")).to_contain_text("stop" if done["finish_reason"] == "stop" else "length")
    assert page.js_errors == []


def test_admin_page_with_a_wrong_token_asks_for_one(page, web_gateway: GatewayServer):
    page.goto(f"{web_gateway.base}/admin/#token=wrong")
    expect(page.locator("#status")).to_contain_text("invalid admin credential", timeout=10_000)
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#tenants tbody tr")).to_have_count(0)
