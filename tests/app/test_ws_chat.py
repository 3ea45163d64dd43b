"""Chats through the real gateway: answers, token counts, cancel, disconnect, priorities, health."""

from __future__ import annotations

import asyncio
import json
import time

from engine import SamplingParams
from tests.app.harness import ChatClient, GatewayServer

PROMPTS = [
    "Once upon a time there was a cat",
    "Tom had a red ball",
    "The sun was shining and the bird",
    "Lily wanted to play in the park",
    "A big dog ran to the tree",
    "Sam and Mia found a box",
]


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_two_tenants_on_several_sockets_get_the_offline_greedy_answers(gateway: GatewayServer, stories_llm):
    max_tokens = 40
    expected = {
        p: stories_llm.chat(_messages(p), SamplingParams(temperature=0, max_tokens=max_tokens))[0] for p in PROMPTS
    }

    async def one_socket(tenant: str, prompts: list[str]) -> list[tuple[str, str, dict]]:
        client = await ChatClient.connect(gateway, gateway.keys[tenant])
        assert client.ready["tenant"] == tenant
        for i, p in enumerate(prompts):  # all chats of the socket in flight at once
            await client.create(f"c{i}", _messages(p), temperature=0, max_tokens=max_tokens)
        results = await asyncio.gather(*(client.collect(f"c{i}") for i in range(len(prompts))))
        await client.close()
        return [(p, text, done) for p, (text, done) in zip(prompts, results)]

    async def main():
        return await asyncio.gather(
            one_socket("alpha", PROMPTS[0:2]), one_socket("alpha", PROMPTS[2:4]),
            one_socket("beta", PROMPTS[3:5]), one_socket("beta", PROMPTS[4:6]),
        )  # fmt: skip

    for socket_results in asyncio.run(main()):
        for prompt, text, done in socket_results:
            want = expected[prompt]
            assert done["type"] == "chat.done", done
            assert text == want.outputs[0].text, prompt
            assert done["finish_reason"] == want.outputs[0].finish_reason
            assert done["usage"] == {
                "prompt_tokens": len(want.prompt_token_ids),
                "completion_tokens": len(want.outputs[0].token_ids),
            }
            assert done["timings"]["ttft_ms"] > 0 and done["timings"]["tokens_per_s"] > 0


def _wait_idle(gateway: GatewayServer, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        health = gateway.health()
        engine = health["engine"]
        idle = engine["running"] == 0 and engine["waiting"] == 0
        if (idle and engine["free_kv_blocks"] == engine["total_kv_blocks"]) or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


def test_cancel_aborts_the_chat_and_reports_abort(gateway: GatewayServer):
    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["alpha"])
        await client.create("long", _messages("Once upon a time"), temperature=0, max_tokens=240, stop=None)
        first = await client.next_event("long")
        assert first["type"] == "chat.delta"
        await client.send({"type": "chat.cancel", "id": "long"})
        _, done = await client.collect("long")
        # The id is free again at once, and the socket goes on.
        text, again = await client.chat("long", _messages("Tom"), temperature=0, max_tokens=4)
        await client.close()
        return done, again

    done, again = asyncio.run(main())
    assert done["type"] == "chat.done" and done["finish_reason"] == "abort"
    assert 1 <= done["usage"]["completion_tokens"] < 240
    assert again["type"] == "chat.done" and again["usage"]["completion_tokens"] == 4
    engine = _wait_idle(gateway, 1.0)["engine"]
    assert engine["running"] == 0 and engine["free_kv_blocks"] == engine["total_kv_blocks"]


def test_disconnect_mid_stream_frees_every_kv_block_within_one_second(gateway: GatewayServer):
    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["beta"])
        for i in range(4):
            await client.create(f"d{i}", _messages(PROMPTS[i]), temperature=0.8, max_tokens=240, seed=i)
        for i in range(4):
            assert (await client.next_event(f"d{i}"))["type"] == "chat.delta"
        busy = gateway.health()["engine"]
        client.ws.transport.abort()  # vanish without a close frame, as a crashed client does
        return busy

    busy = asyncio.run(main())
    assert busy["running"] >= 1 and busy["free_kv_blocks"] < busy["total_kv_blocks"]
    t0 = time.monotonic()
    engine = _wait_idle(gateway, 1.0)["engine"]
    assert time.monotonic() - t0 < 1.0
    assert engine["running"] == 0 and engine["waiting"] == 0
    assert engine["free_kv_blocks"] == engine["total_kv_blocks"]


def test_priority_the_tenant_may_not_use_is_refused(gateway: GatewayServer):
    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["beta"])
        assert client.ready["priorities"] == ["standard", "batch"]
        await client.send({"type": "chat.create", "id": "p", "messages": _messages("Hi"), "priority": "interactive"})
        err = await client.next_event("p")
        await client.send({"type": "chat.create", "id": "q", "messages": _messages("Hi"),
                           "priority": "batch", "params": {"max_tokens": 3}})  # fmt: skip
        _, done = await client.collect("q")
        await client.close()
        return err, done

    err, done = asyncio.run(main())
    assert err["type"] == "error" and err["code"] == "forbidden_priority" and "interactive" in err["message"]
    assert done["type"] == "chat.done"


def test_ping_is_answered_with_pong(gateway: GatewayServer):
    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["alpha"])
        await client.send({"type": "ping", "data": {"n": 7}})
        pong = await client.next_event(None, timeout=5)
        await client.close()
        return pong

    assert asyncio.run(main()) == {"type": "pong", "data": {"n": 7}}


def test_health_reports_engine_state_and_database(gateway: GatewayServer):
    health = gateway.health()
    assert health["status"] == "ok" and health["database"] == "ok"
    assert health["model"] == "stories260k"
    assert set(health["engine"]) == {"running", "waiting", "swapped", "free_kv_blocks", "total_kv_blocks", "alive"}
    assert health["engine"]["alive"] is True
    assert health["engine"]["total_kv_blocks"] > 0
    stats = health["stats"]
    for key in ("num_preemptions", "num_swapped_out_blocks", "num_swapped_in_blocks", "prefix_cache_queried_tokens",
                "prefix_cache_hit_tokens", "free_gpu_blocks", "total_gpu_blocks", "free_cpu_blocks"):
        assert isinstance(stats[key], int) and stats[key] >= 0, key
    assert stats["total_gpu_blocks"] == health["engine"]["total_kv_blocks"]


def test_chat_page_is_served_with_a_content_security_policy(gateway: GatewayServer):
    import httpx

    page = httpx.get(f"{gateway.base}/", timeout=5)
    assert page.status_code == 200 and "app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{gateway.base}/vendor/marked.umd.js", timeout=5).status_code == 200


def test_cancel_sent_right_after_create_still_ends_the_chat(gateway: GatewayServer):
    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["alpha"])
        create = {"type": "chat.create", "id": "z", "messages": _messages("Once"), "params": {"max_tokens": 200}}
        await client.send(json.dumps(create))
        await client.send({"type": "chat.cancel", "id": "z"})
        _, done = await client.collect("z")
        _, again = await client.chat("z", _messages("Tom"), temperature=0, max_tokens=3)
        await client.close()
        return done, again

    done, again = asyncio.run(main())
    assert done["type"] == "chat.done" and done["finish_reason"] == "abort"
    assert again["type"] == "chat.done" and again["usage"]["completion_tokens"] == 3
    engine = _wait_idle(gateway, 1.0)["engine"]
    assert engine["running"] == 0 and engine["free_kv_blocks"] == engine["total_kv_blocks"]
