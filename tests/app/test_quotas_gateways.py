"""Quotas through the real gateway: two ``chatgate serve`` processes sharing one PostgreSQL
never admit more than the budget allows; a stream cut off by a disconnect is charged
for the tokens it produced; nothing stays reserved afterwards."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from tenancy import Quotas, TenancyStore
from tenancy.migrate import upgrade
from tests.app.harness import ChatClient, GatewayServer
from tests.tenancy.conftest import postgresql_url  # noqa: F401

PROMPT = [{"role": "user", "content": "Once upon a time"}]
MAX_TOKENS = 8


@dataclass
class PgGateway(GatewayServer):
    """A gateway on a given database URL (the harness defaults to its own SQLite file)."""

    url: str = ""

    @property
    def database_url(self) -> str:
        return self.url


async def _store_call(url: str, fn):
    async with TenancyStore(url) as store:
        return await fn(store)


async def _fire(gateway: GatewayServer, key: str, tag: str, n: int) -> list[dict]:
    client = await ChatClient.connect(gateway, key)
    try:
        ids = [f"{tag}-{i}" for i in range(n)]
        await asyncio.gather(*(client.create(i, PROMPT, temperature=0, max_tokens=MAX_TOKENS) for i in ids))
        return [(await client.collect(i, timeout=120))[1] for i in ids]
    finally:
        await client.close()


def test_two_gateways_on_one_postgresql_never_pass_the_budget(tmp_path, stories_path, postgresql_url):
    upgrade(postgresql_url)

    async def setup(store):
        tenant = await store.create_tenant("flood", quotas=Quotas(tokens_per_day=600))
        return tenant.id, (await store.create_key("flood"))[1]

    tenant_id, key = asyncio.run(_store_call(postgresql_url, setup))
    gateways = [PgGateway(tmp_path / name, "stories260k", 256, url=postgresql_url) for name in ("a", "b")]
    for g in gateways:
        g.workdir.mkdir()
        g.start()
    try:
        async def flood():  # 200 chats: 4 sockets x 25 chats on each gateway
            batches = [_fire(g, key, f"{g.port}-{s}", 25) for g in gateways for s in range(4)]
            return [event for batch in await asyncio.gather(*batches) for event in batch]

        events = asyncio.run(flood())
    finally:
        for g in gateways:
            g.stop()
    admitted = [e for e in events if e["type"] == "chat.done"]
    refused = [e for e in events if e["type"] == "error"]
    assert len(events) == 200 and len(admitted) + len(refused) == 200
    assert admitted and refused
    assert {(e["code"], e["quota"], e["retryable"]) for e in refused} == {("quota_exceeded", "tokens_per_day", False)}
    assert all(e["retry_after_ms"] > 0 for e in refused)

    async def check(store):
        return (await store.quotas.live_usage(tenant_id))[tenant_id], await store.quotas.recent(tenant_id, 1000)

    live, rows = asyncio.run(_store_call(postgresql_url, check))
    charged = sum(e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"] for e in admitted)
    assert live.day_tokens <= 600  # the DB's used counter never passes the limit
    assert live.day_tokens == charged == sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert (live.in_flight, live.reserved_tokens) == (0, 0)  # every reservation settled
    assert len(rows) == len(admitted)
    cost = rows[0]["reserved_tokens"]
    assert len(admitted) <= 600 // min(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert cost == rows[0]["prompt_tokens"] + MAX_TOKENS


def test_a_stream_cut_off_by_disconnect_is_charged_for_what_it_produced(gateway: GatewayServer):
    key = gateway.add_tenant("cutoff", quotas=Quotas(tokens_per_day=100_000))

    async def go():
        client = await ChatClient.connect(gateway, key)
        await client.create("c1", [{"role": "user", "content": "Once"}], temperature=0, max_tokens=200)
        deltas = 0
        while deltas < 3:
            event = await client.next_event("c1", 60)
            assert event["type"] == "chat.delta", event
            deltas += 1
        client.ws.transport.abort()  # the TCP connection drops: no close frame, as a crashed client
        client._reader.cancel()
        return deltas

    deltas = asyncio.run(go())

    async def check(store):
        tenant = await store.get_tenant("cutoff")
        return (await store.quotas.live_usage(tenant.id))[tenant.id], await store.quotas.recent(tenant.id)

    deadline = time.monotonic() + 20
    while True:
        live, rows = gateway.run_store(check)
        if (rows and live.in_flight == 0) or time.monotonic() > deadline:  # two reads: wait for both
            break
        time.sleep(0.1)
    [row] = rows
    assert row["finish_reason"] == "abort"
    assert deltas <= row["completion_tokens"] < 200
    assert live.day_tokens == row["prompt_tokens"] + row["completion_tokens"] > 0
    assert (live.in_flight, live.reserved_tokens) == (0, 0)
