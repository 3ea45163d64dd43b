"""ChatService on SQLite and PostgreSQL with a scripted engine: every way a chat can end
settles its reservation (no leak), refusals come before the engine sees anything."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from app.chat_service import ChatService, PriorityNotAllowedError, QuotaExceededError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tenancy import Principal, Quotas
from tests.tenancy.conftest import database_url, migrated_url, postgresql_url, sqlite_url, store  # noqa: F401

pytestmark = pytest.mark.anyio


@dataclass
class ScriptedLLM:
    """Yields one token per step; ``fail_at`` raises at that step, ``error_at`` ends with finish_reason error."""

    step_s: float = 0.001
    seen: list[dict] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    plans: dict[str, tuple[str, int]] = field(default_factory=dict)  # request_id -> (mode, step)

    async def generate(self, prompt, params, request_id, *, tenant_id, priority, weight):
        self.seen.append({"request_id": request_id, "tenant_id": tenant_id, "priority": priority, "weight": weight})
        mode, at = self.plans.get(request_id, ("ok", params.max_tokens))
        metrics = RequestMetrics(arrival_time=0.0)
        tokens: list[int] = []
        for i in range(params.max_tokens):
            await asyncio.sleep(self.step_s)
            if mode == "raise" and i == at:
                raise RuntimeError("scripted engine failure")
            tokens.append(i)
            metrics.first_token_time = metrics.first_token_time or 0.001
            last = i == params.max_tokens - 1 or (mode == "error" and i == at)
            reason = ("error" if mode == "error" else "length") if last else None
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", list(tokens), reason, "x")],
                                last, metrics)  # fmt: skip
            if last:
                return

    async def abort(self, request_id):
        self.aborted.append(request_id)


def _principal(tenant_id: int, allowed=("standard", "batch"), weight=2.0) -> Principal:
    return Principal(tenant_id=tenant_id, tenant_name="acme", key_id=7, key_prefix="cg_acmeacme", weight=weight,
                     allowed_priorities=frozenset(allowed))  # fmt: skip


async def _consume(stream, stop_after: int | None = None) -> int:
    n = 0
    async with contextlib.aclosing(stream):
        async for _ in stream:
            n += 1
            if stop_after is not None and n >= stop_after:
                break
    return n


async def test_engine_gets_tenant_priority_and_weight(store):
    tenant = (await store.create_tenant("acme")).id
    llm = ScriptedLLM()
    service = ChatService(llm, store)
    params = SimpleNamespace(max_tokens=3)
    assert await _consume(service.run(_principal(tenant), "r1", [1, 2], params, "batch")) == 3
    assert llm.seen == [{"request_id": "r1", "tenant_id": str(tenant), "priority": 2, "weight": 2.0}]
    [row] = await store.quotas.recent(tenant)
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"], row["key_id"]) == (2, 3, "length", 7)


async def test_forbidden_priority_and_quota_refusals_never_reach_the_engine(store):
    tenant = (await store.create_tenant("acme", quotas=Quotas(tokens_per_minute=10))).id
    llm = ScriptedLLM()
    service = ChatService(llm, store)
    with pytest.raises(PriorityNotAllowedError, match="interactive"):
        await _consume(service.run(_principal(tenant), "r1", [1], SimpleNamespace(max_tokens=3), "interactive"))
    with pytest.raises(QuotaExceededError) as info:
        await _consume(service.run(_principal(tenant), "r2", [1] * 8, SimpleNamespace(max_tokens=3), None))
    assert info.value.quota_name == "tokens_per_minute" and info.value.limit == 10 and not info.value.retryable
    assert llm.seen == []
    live = (await store.quotas.live_usage(tenant))[tenant]
    assert (live.in_flight, live.reserved_tokens, live.minute_tokens) == (0, 0, 0)


async def test_random_cancels_closes_and_errors_never_leak_a_reservation(store):
    tenant = (await store.create_tenant("acme", quotas=Quotas(max_concurrent_chats=25, tokens_per_day=10**6))).id
    rng = random.Random(1234)
    llm = ScriptedLLM()
    service = ChatService(llm, store)
    modes = ["ok", "raise", "error", "cancel", "close"]
    tasks = []
    for i in range(120):
        rid = f"r{i}"
        mode = rng.choice(modes)
        llm.plans[rid] = (mode, rng.randint(0, 5))
        stream = service.run(_principal(tenant), rid, [1, 2, 3], SimpleNamespace(max_tokens=6), "standard")
        tasks.append((mode, asyncio.create_task(_consume(stream, 2 if mode == "close" else None))))
    await asyncio.sleep(0.004)
    for mode, task in tasks:
        if mode == "cancel":
            task.cancel()
    results = await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
    await service.drain()
    refused = sum(1 for r in results if isinstance(r, QuotaExceededError))
    cancelled = sum(1 for r in results if isinstance(r, asyncio.CancelledError))
    assert refused > 0  # the concurrency limit refused some
    live = (await store.quotas.live_usage(tenant))[tenant]
    assert (live.in_flight, live.reserved_tokens) == (0, 0)  # reserved == settled
    rows = await store.quotas.recent(tenant, limit=1000)
    # Every admitted chat has its usage row (a chat cancelled while reserving may or may not have one).
    assert 120 - refused - cancelled <= len(rows) <= 120 - refused
    assert live.day_tokens == sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert {r["finish_reason"] for r in rows} <= {"length", "error", "abort"}


async def test_settlement_survives_a_second_cancellation(store):
    tenant = (await store.create_tenant("acme")).id
    service = ChatService(ScriptedLLM(step_s=0.01), store)
    stream = service.run(_principal(tenant), "r1", [1], SimpleNamespace(max_tokens=50), None)

    streaming = asyncio.Event()

    async def consume():
        async for _ in stream:
            streaming.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(streaming.wait(), 10)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # a second cancel lands while settling
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await stream.aclose()
    await service.drain()
    live = (await store.quotas.live_usage(tenant))[tenant]
    assert (live.in_flight, live.reserved_tokens) == (0, 0)
    [row] = await store.quotas.recent(tenant)
    assert row["finish_reason"] == "abort" and 1 <= row["completion_tokens"] < 50
