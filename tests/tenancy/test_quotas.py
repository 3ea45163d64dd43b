"""Quota reservation and settlement at the store level, on SQLite and PostgreSQL.

The reservation is one conditional UPDATE; these tests hammer it with concurrent
tasks (and, on PostgreSQL, with two stores = two connection pools, as two gateway
processes would) and check it never admits more than a limit allows, that the
window roll-over works, and that settlement puts every counter back.
"""

from __future__ import annotations

import asyncio
import calendar
import random

import pytest

from tenancy import QuotaExceededError, Quotas, TenancyStore
from tenancy.quotas import Settlement, Windows

pytestmark = pytest.mark.anyio

DONE = Settlement(completion_tokens=0, finish_reason="stop", ttft_ms=None, total_ms=1.0)


async def _tenant(store: TenancyStore, name: str = "acme", **quotas) -> int:
    return (await store.create_tenant(name, quotas=Quotas(**quotas))).id


async def _try_reserve(store: TenancyStore, tenant_id: int, i: int, prompt: int = 10, max_tokens: int = 10):
    try:
        return await store.quotas.reserve(tenant_id, None, f"r{i}", "standard", prompt, max_tokens)
    except QuotaExceededError as error:
        return error


async def test_concurrent_reservations_never_pass_the_token_budget(store, migrated_url):
    tenant = await _tenant(store, tokens_per_day=1000)  # 50 requests of 20 tokens
    async with TenancyStore(migrated_url) as second:  # a second pool, as a second gateway would have
        results = await asyncio.gather(
            *(_try_reserve(store if i % 2 else second, tenant, i) for i in range(200))
        )
    admitted = [r for r in results if not isinstance(r, QuotaExceededError)]
    refused = [r for r in results if isinstance(r, QuotaExceededError)]
    assert len(admitted) == 50 and len(refused) == 150
    assert {r.quota_name for r in refused} == {"tokens_per_day"}
    assert all(not r.retryable and 0 < r.retry_after_s <= 86400 for r in refused)
    live = (await store.quotas.live_usage(tenant))[tenant]
    assert live.day_tokens == 1000 and live.in_flight == 50 and live.reserved_tokens == 1000


async def test_concurrency_limit_admits_exactly_the_limit(store):
    tenant = await _tenant(store, max_concurrent_chats=7)
    results = await asyncio.gather(*(_try_reserve(store, tenant, i) for i in range(60)))
    admitted = [r for r in results if not isinstance(r, QuotaExceededError)]
    assert len(admitted) == 7
    refused = [r for r in results if isinstance(r, QuotaExceededError)]
    assert {(r.quota_name, r.retryable, r.retry_after_s) for r in refused} == {("max_concurrent_chats", True, None)}
    await store.quotas.settle(admitted[0], DONE)
    assert not isinstance(await _try_reserve(store, tenant, 99), QuotaExceededError)


async def test_requests_per_minute_rolls_over_with_the_window(migrated_url):
    now = [1_700_000_000.0 - 1_700_000_000.0 % 60 + 5]  # 5 s into a minute
    async with TenancyStore(migrated_url, clock=lambda: now[0]) as store:
        tenant = await _tenant(store, requests_per_minute=3, tokens_per_minute=1000)
        for i in range(3):
            await store.quotas.reserve(tenant, None, f"r{i}", "batch", 1, 1)
        refusal = await _try_reserve(store, tenant, 3, 1, 1)
        assert isinstance(refusal, QuotaExceededError)
        assert refusal.quota_name == "requests_per_minute" and refusal.retryable
        assert refusal.retry_after_s == pytest.approx(55.0)
        now[0] += 60
        assert not isinstance(await _try_reserve(store, tenant, 4, 1, 1), QuotaExceededError)
        live = (await store.quotas.live_usage(tenant))[tenant]
        assert live.minute_requests == 1 and live.minute_tokens == 2


async def test_request_larger_than_a_limit_is_not_retryable(store):
    tenant = await _tenant(store, tokens_per_minute=100)
    refusal = await _try_reserve(store, tenant, 0, prompt=80, max_tokens=40)
    assert isinstance(refusal, QuotaExceededError)
    assert refusal.quota_name == "tokens_per_minute" and refusal.limit == 100
    assert refusal.retryable is False and refusal.retry_after_s is None


async def test_settlement_replaces_reserved_by_real_cost_and_writes_a_usage_row(store):
    tenant = await _tenant(store, tokens_per_day=10_000, tokens_per_month=10_000)
    reservation = await store.quotas.reserve(tenant, 42, "req-1", "interactive", 30, 100)
    await store.quotas.settle(reservation, Settlement(12, "stop", ttft_ms=5.0, total_ms=40.0))
    live = (await store.quotas.live_usage(tenant))[tenant]
    assert (live.day_tokens, live.month_tokens, live.minute_tokens) == (42, 42, 42)
    assert (live.in_flight, live.reserved_tokens) == (0, 0)
    [row] = await store.quotas.recent(tenant)
    assert row["key_id"] == 42 and row["request_id"] == "req-1" and row["priority"] == "interactive"
    assert (row["prompt_tokens"], row["completion_tokens"], row["reserved_tokens"]) == (30, 12, 130)
    assert row["finish_reason"] == "stop" and row["ttft_ms"] == 5.0 and row["total_ms"] == 40.0


async def test_random_settle_orders_never_leak(store):
    tenant = await _tenant(store, max_concurrent_chats=20, tokens_per_day=100_000)
    rng = random.Random(6)

    async def one(i: int) -> int:
        r = await _try_reserve(store, tenant, i)
        if isinstance(r, QuotaExceededError):
            return 0
        await asyncio.sleep(rng.random() / 100)
        produced = rng.randint(0, 10)
        await store.quotas.settle(r, Settlement(produced, rng.choice(["stop", "abort", "error"]), None, 1.0))
        return 10 + produced

    charged = sum(await asyncio.gather(*(one(i) for i in range(100))))
    live = (await store.quotas.live_usage(tenant))[tenant]
    assert (live.in_flight, live.reserved_tokens) == (0, 0)
    assert live.day_tokens == charged
    totals = (await store.quotas.totals())[tenant]
    assert totals["prompt_tokens"] + totals["completion_tokens"] == charged


async def test_quota_change_applies_to_the_next_reservation(store):
    tenant = await _tenant(store, max_concurrent_chats=1)
    await store.quotas.reserve(tenant, None, "a", "standard", 1, 1)
    assert isinstance(await _try_reserve(store, tenant, 1), QuotaExceededError)
    await store.update_tenant(tenant, quotas=Quotas(max_concurrent_chats=2))
    assert not isinstance(await _try_reserve(store, tenant, 2), QuotaExceededError)


async def test_series_buckets_usage_by_minute(migrated_url):
    now = [1_700_000_000.0]
    async with TenancyStore(migrated_url, clock=lambda: now[0]) as store:
        tenant = await _tenant(store)
        for step in range(6):  # one request per minute
            r = await store.quotas.reserve(tenant, None, f"r{step}", "batch", 2, 3)
            await store.quotas.settle(r, Settlement(3, "length", None, 1.0))
            now[0] += 60
        start = int(1_700_000_000 // 60)
        series = await store.quotas.series(tenant, start, bucket_minutes=2)
        assert [(b["start_minute"] - start, b["requests"], b["completion_tokens"]) for b in series] == [
            (0, 2, 6), (2, 2, 6), (4, 2, 6),
        ]


def test_month_window_resets_on_the_first():
    w = Windows.at(calendar.timegm((2025, 12, 31, 23, 0, 0)))
    assert w.seconds_to_next_month() == 3600 and w.seconds_to_next_day() == 3600
