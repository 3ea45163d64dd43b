"""``chatgate_sdk.Client`` against the real gateway (``chatgate serve`` on stories260k)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from chatgate_sdk import AuthError, Client, ConnectionLost, InvalidRequest, QuotaExceeded
from tenancy.records import Quotas
from tests.app.harness import GatewayServer

PROMPTS = ["Once upon a time there was a cat", "Tom had a red ball", "Lily wanted to play in the park",
           "A big dog ran to the tree", "Sam and Mia found a box", "The sun was shining"]  # fmt: skip


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, stories_path) -> GatewayServer:
    s = GatewayServer(tmp_path_factory.mktemp("sdk-gateway"), "stories260k", 256)
    s.start()
    try:
        s.add_tenant("alpha", allowed_priorities={"interactive", "standard", "batch"})
        s.add_tenant("limited", quotas=Quotas(requests_per_minute=1))
        yield s
    finally:
        s.stop()


def _wait_idle(server: GatewayServer, within_s: float = 10.0) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        engine = server.health()["engine"]
        if (engine["running"] == 0 and engine["waiting"] == 0) or time.monotonic() > deadline:
            return engine
        time.sleep(0.02)


def test_importing_the_sdk_loads_neither_torch_nor_the_engine():
    code = "import sys, chatgate_sdk; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'app')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_concurrent_chats_over_one_connection_get_their_own_answers(server: GatewayServer):
    async def main():
        async with Client(server.ws_url, server.keys["alpha"]) as client:
            alone = [await client.complete(_messages(p), temperature=0, max_tokens=30) for p in PROMPTS]
            streams = [client.chat(_messages(p), temperature=0, max_tokens=30) for p in PROMPTS]
            together = await asyncio.gather(*(s.text() for s in streams))
            return client.ready, alone, together, [s.result for s in streams]

    ready, alone, together, results = asyncio.run(main())
    assert ready["tenant"] == "alpha"
    assert together == alone and all(alone)
    assert all(r.finish_reason in ("stop", "length") and r.completion_tokens > 0 for r in results)


def test_deltas_stream_in_pieces_and_result_has_usage(server: GatewayServer):
    async def main():
        async with Client(server.base, server.keys["alpha"]) as client:  # an http:// base URL works too
            stream = client.chat(_messages(PROMPTS[0]), temperature=0, max_tokens=20, priority="interactive")
            return [d async for d in stream], stream.result

    deltas, result = asyncio.run(main())
    assert len(deltas) > 3
    assert result.finish_reason == "length" and result.completion_tokens == 20 and result.prompt_tokens > 0


def test_cancel_stops_the_chat_on_the_server_and_the_connection_goes_on(server: GatewayServer):
    async def main():
        async with Client(server.ws_url, server.keys["alpha"]) as client:
            stream = client.chat(_messages("Once upon a time"), temperature=0, max_tokens=240)
            got = []
            async for delta in stream:
                got.append(delta)
                if len(got) == 1:
                    await stream.cancel()
            after = await client.complete(_messages("Tom"), temperature=0, max_tokens=4)
            return stream.result, after

    result, after = asyncio.run(main())
    assert result.finish_reason == "abort" and result.completion_tokens < 240
    assert after
    assert _wait_idle(server)["running"] == 0


def test_leaving_a_chat_early_cancels_it(server: GatewayServer):
    async def main():
        async with Client(server.ws_url, server.keys["alpha"]) as client:
            async with client.chat(_messages("Once upon a time"), temperature=0, max_tokens=240) as stream:
                async for _ in stream:
                    break
            return await client.complete(_messages("Tom"), temperature=0, max_tokens=4)

    assert asyncio.run(main())
    engine = _wait_idle(server)
    assert engine["running"] == 0 and engine["free_kv_blocks"] == engine["total_kv_blocks"]


def test_a_bad_key_is_an_auth_error(server: GatewayServer):
    async def main():
        async with Client(server.ws_url, "cg_nothere0_" + "x" * 43):
            pass

    with pytest.raises(AuthError):
        asyncio.run(main())


def test_refusals_are_typed_and_the_connection_stays_usable(server: GatewayServer):
    async def main():
        async with Client(server.ws_url, server.keys["limited"]) as client:
            with pytest.raises(InvalidRequest) as bad:
                await client.complete(_messages("Tom"), temperature=9)
            assert await client.complete(_messages("Tom"), temperature=0, max_tokens=3)
            with pytest.raises(QuotaExceeded) as refused:
                await client.complete(_messages("Tom"), temperature=0, max_tokens=3)
            with pytest.raises(InvalidRequest) as forbidden:
                await client.complete(_messages("Tom"), priority="interactive")
            return bad.value, refused.value, forbidden.value

    bad, refused, forbidden = asyncio.run(main())
    assert bad.code == "invalid_params"
    assert refused.quota == "requests_per_minute" and refused.limit == 1 and refused.retryable
    assert 0 < refused.retry_after_s <= 60
    assert forbidden.code == "forbidden_priority"


def test_a_server_restart_is_survived_by_reconnecting(tmp_path_factory: pytest.TempPathFactory, stories_path):
    server = GatewayServer(tmp_path_factory.mktemp("sdk-restart"), "stories260k", 256)
    server.start()
    try:
        async def main():
            async with Client(server.ws_url, server.keys["local"], backoff_initial_s=0.1, backoff_max_s=1.0,
                              max_reconnect_attempts=None) as client:  # fmt: skip
                before = await client.complete(_messages("Tom had"), temperature=0, max_tokens=8)
                tasks = [asyncio.create_task(client.complete(_messages(p), temperature=0, max_tokens=240))
                         for p in PROMPTS[1:]]  # fmt: skip
                probe = client.chat(_messages(PROMPTS[0]), temperature=0, max_tokens=240)
                await probe.__anext__()  # the chats are running: now restart the server under them
                await asyncio.to_thread(server.stop)
                tasks.append(asyncio.create_task(probe.text()))
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.to_thread(server.start)
                after = await client.complete(_messages("Tom had"), temperature=0, max_tokens=8)
                return before, outcomes, after, client.reconnects

        before, outcomes, after, reconnects = asyncio.run(main())
    finally:
        server.stop()
    assert any(isinstance(o, ConnectionLost) for o in outcomes), outcomes
    assert all(isinstance(o, (str, ConnectionLost)) for o in outcomes), outcomes
    assert after == before and reconnects >= 1
