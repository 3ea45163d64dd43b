"""Atomic quota reservation and settlement, and the usage ledger.

A request reserves its maximum cost (prompt tokens + max_tokens) before the
engine sees it, with ONE conditional ``UPDATE`` on the tenant's ``tenant_usage``
row: the ``WHERE`` clause checks every limit against the counters as they will
be after the reservation, with the window roll-over (a new minute, UTC day or
month counts from 0) written as ``CASE`` on the stored window start, and the
``SET`` clause applies the same roll-over. ``rowcount == 1`` means admitted.

Why it cannot overshoot with many gateway processes: PostgreSQL takes the row
lock for the ``UPDATE`` and, when it had to wait for a concurrent writer,
re-evaluates the ``WHERE`` on the committed new row version (READ COMMITTED
re-check); SQLite serialises writers. The limits come from uncorrelated scalar
subqueries on ``tenants``, so a limit changed by an admin applies to the next
reservation without any cache.

Settlement (however the request ended) is one ``UPDATE`` that frees the
concurrency slot and replaces the reserved cost by the real one in the windows
that are still current, plus one ``INSERT`` of the usage row, in one transaction.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import func, insert, select, text

from .errors import QuotaExceededError
from .models import Tenant, TenantUsage, UsageRecord, utcnow
from .records import Quotas

_RESERVE_ATTEMPTS = 5

# Effective counters in the current windows (a stale window counts as 0).
_MIN_REQ = "(CASE WHEN minute_start = :minute THEN minute_requests ELSE 0 END)"
_MIN_TOK = "(CASE WHEN minute_start = :minute THEN minute_tokens ELSE 0 END)"
_DAY_TOK = "(CASE WHEN day_start = :day THEN day_tokens ELSE 0 END)"
_MON_TOK = "(CASE WHEN month_start = :month THEN month_tokens ELSE 0 END)"


def _limit(column: str) -> str:
    return f"(SELECT {column} FROM tenants WHERE id = :tenant_id)"


def _within(column: str, after: str) -> str:
    return f"({_limit(column)} IS NULL OR {after} <= {_limit(column)})"


_RESERVE_SQL = text(
    f"""
    UPDATE tenant_usage SET
        minute_requests = {_MIN_REQ} + 1,
        minute_tokens = {_MIN_TOK} + :cost,
        minute_start = :minute,
        day_tokens = {_DAY_TOK} + :cost,
        day_start = :day,
        month_tokens = {_MON_TOK} + :cost,
        month_start = :month,
        in_flight = in_flight + 1,
        reserved_tokens = reserved_tokens + :cost
    WHERE tenant_id = :tenant_id
      AND {_within("max_concurrent_chats", "in_flight + 1")}
      AND {_within("requests_per_minute", _MIN_REQ + " + 1")}
      AND {_within("tokens_per_minute", _MIN_TOK + " + :cost")}
      AND {_within("tokens_per_day", _DAY_TOK + " + :cost")}
      AND {_within("tokens_per_month", _MON_TOK + " + :cost")}
    """
)

_SETTLE_SQL = text(
    """
    UPDATE tenant_usage SET
        in_flight = in_flight - 1,
        reserved_tokens = reserved_tokens - :reserved,
        minute_tokens = CASE WHEN minute_start = :minute THEN minute_tokens + :delta ELSE minute_tokens END,
        day_tokens = CASE WHEN day_start = :day THEN day_tokens + :delta ELSE day_tokens END,
        month_tokens = CASE WHEN month_start = :month THEN month_tokens + :delta ELSE month_tokens END
    WHERE tenant_id = :tenant_id
    """
)


@dataclass(frozen=True)
class Windows:
    """The current quota windows at ``now`` (unix seconds, UTC)."""

    now: float
    minute: int  # unix minute
    day: int  # unix day
    month: int  # year * 12 + month - 1

    @classmethod
    def at(cls, now: float) -> Windows:
        moment = datetime.fromtimestamp(now, timezone.utc)
        return cls(now, int(now // 60), int(now // 86400), moment.year * 12 + moment.month - 1)

    def seconds_to_next_minute(self) -> float:
        return 60.0 - (self.now % 60.0)

    def seconds_to_next_day(self) -> float:
        return 86400.0 - (self.now % 86400.0)

    def seconds_to_next_month(self) -> float:
        year, month0 = divmod(self.month + 1, 12)
        return calendar.timegm((year, month0 + 1, 1, 0, 0, 0)) - self.now


@dataclass(frozen=True)
class Reservation:
    """A reserved request; hand it back to ``QuotaLedger.settle`` exactly once.

    ``cost`` is the reserved token count (prompt + max_tokens); the windows are the
    ones the cost was charged to.
    """

    tenant_id: int
    key_id: int | None
    request_id: str
    priority: str
    prompt_tokens: int
    cost: int
    windows: Windows


@dataclass(frozen=True)
class Settlement:
    """What a request really cost and how it went (units in the names)."""

    completion_tokens: int
    finish_reason: str  # stop, length, abort, error, refused...
    ttft_ms: float | None
    total_ms: float
    charged_prompt: bool = True  # False when the engine never took the request


@dataclass(frozen=True)
class LiveUsage:
    """A tenant's counters in the current windows, with its limits beside them."""

    tenant_id: int
    quotas: Quotas
    minute_requests: int = 0
    minute_tokens: int = 0
    in_flight: int = 0
    reserved_tokens: int = 0  # tokens reserved by requests still running
    day_tokens: int = 0
    month_tokens: int = 0


class QuotaLedger:
    """Reservations, settlements and usage reads over the tenancy database.

    Args:
        transaction: the store's ``_transaction`` context factory (translates
            database failures into ``StoreUnavailableError``).
        clock: unix seconds (UTC); injectable for tests of window roll-over.
    """

    def __init__(self, transaction: Callable, clock: Callable[[], float] = time.time) -> None:
        self._transaction = transaction
        self._clock = clock

    async def reserve(
        self, tenant_id: int, key_id: int | None, request_id: str, priority: str, prompt_tokens: int, max_tokens: int
    ) -> Reservation:
        """Reserve ``prompt_tokens + max_tokens`` tokens, one request and one concurrent slot.

        Raises:
            QuotaExceededError: a limit would be passed; nothing was reserved.
            StoreUnavailableError: the database cannot be used; nothing was reserved.
        """
        cost = int(prompt_tokens) + int(max_tokens)
        for _ in range(_RESERVE_ATTEMPTS):
            windows = Windows.at(self._clock())
            params = {"tenant_id": tenant_id, "cost": cost, "minute": windows.minute, "day": windows.day,
                      "month": windows.month}  # fmt: skip
            async with self._transaction() as session:
                if (await session.execute(_RESERVE_SQL, params)).rowcount == 1:
                    return Reservation(tenant_id, key_id, request_id, priority, int(prompt_tokens), cost, windows)
            # Refused, or no counter row yet: find out which, outside the hot statement.
            live = await self._live(tenant_id, windows, create=True)
            refusal = _refusal(live, cost, windows)
            if refusal is not None:
                raise refusal
        raise QuotaExceededError("max_concurrent_chats", live.quotas.max_concurrent_chats or 0, None, True,
                                 "too much contention on the quota counters")  # fmt: skip

    async def settle(self, reservation: Reservation, outcome: Settlement) -> None:
        """Free the reservation's slot, charge the real cost, write the usage row (one transaction).

        Raises:
            StoreUnavailableError: the database cannot be used (the caller retries).
        """
        r = reservation
        prompt = r.prompt_tokens if outcome.charged_prompt else 0
        actual = prompt + max(0, int(outcome.completion_tokens))
        params = {"tenant_id": r.tenant_id, "reserved": r.cost, "delta": actual - r.cost,
                  "minute": r.windows.minute, "day": r.windows.day, "month": r.windows.month}  # fmt: skip
        async with self._transaction() as session:
            await session.execute(_SETTLE_SQL, params)
            await session.execute(
                insert(UsageRecord).values(
                    tenant_id=r.tenant_id, key_id=r.key_id, request_id=r.request_id[:128], priority=r.priority,
                    prompt_tokens=prompt, completion_tokens=max(0, int(outcome.completion_tokens)),
                    reserved_tokens=r.cost, ttft_ms=outcome.ttft_ms, total_ms=outcome.total_ms,
                    finish_reason=outcome.finish_reason[:16], minute=int(self._clock() // 60), created_at=utcnow(),
                )  # fmt: skip
            )

    async def live_usage(self, tenant_id: int | None = None) -> dict[int, LiveUsage]:
        """Current-window counters of one tenant or of all, keyed by tenant id."""
        windows = Windows.at(self._clock())
        async with self._transaction() as session:
            stmt = select(Tenant, TenantUsage).outerjoin(TenantUsage, TenantUsage.tenant_id == Tenant.id)
            if tenant_id is not None:
                stmt = stmt.where(Tenant.id == tenant_id)
            rows = (await session.execute(stmt)).all()
        return {t.id: _live_usage(t, u, windows) for t, u in rows}

    async def totals(self, since_minute: int = 0) -> dict[int, dict[str, int]]:
        """Per tenant id: ``requests``, ``prompt_tokens``, ``completion_tokens`` since a unix minute."""
        stmt = (
            select(UsageRecord.tenant_id, func.count(), func.sum(UsageRecord.prompt_tokens),
                   func.sum(UsageRecord.completion_tokens))
            .where(UsageRecord.minute >= since_minute)
            .group_by(UsageRecord.tenant_id)
        )  # fmt: skip
        async with self._transaction() as session:
            rows = (await session.execute(stmt)).all()
        return {
            t: {"requests": int(n), "prompt_tokens": int(p or 0), "completion_tokens": int(c or 0)}
            for t, n, p, c in rows
        }

    async def series(self, tenant_id: int, since_minute: int, bucket_minutes: int) -> list[dict[str, int]]:
        """Usage of one tenant in buckets of ``bucket_minutes`` from ``since_minute`` (unix minutes).

        Returns only non-empty buckets, oldest first: ``start_minute``, ``requests``,
        ``prompt_tokens``, ``completion_tokens``.
        """
        bucket = ((UsageRecord.minute - since_minute) // bucket_minutes).label("bucket")
        stmt = (
            select(bucket, func.count(), func.sum(UsageRecord.prompt_tokens), func.sum(UsageRecord.completion_tokens))
            .where(UsageRecord.tenant_id == tenant_id, UsageRecord.minute >= since_minute)
            .group_by(bucket)
            .order_by(bucket)
        )
        async with self._transaction() as session:
            rows = (await session.execute(stmt)).all()
        return [
            {"start_minute": since_minute + int(b) * bucket_minutes, "requests": int(n),
             "prompt_tokens": int(p or 0), "completion_tokens": int(c or 0)}
            for b, n, p, c in rows
        ]  # fmt: skip

    async def recent(self, tenant_id: int, limit: int = 50) -> list[dict]:
        """The tenant's latest usage rows, newest first, as plain dicts (column: value)."""
        async with self._transaction() as session:
            stmt = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
            rows = await session.scalars(stmt.order_by(UsageRecord.id.desc()).limit(limit))
            return [{c.name: getattr(r, c.name) for c in UsageRecord.__table__.columns} for r in rows]

    async def _live(self, tenant_id: int, windows: Windows, *, create: bool) -> LiveUsage:
        async with self._transaction() as session:
            if create:
                await session.execute(
                    text("INSERT INTO tenant_usage (tenant_id, minute_start, minute_requests, minute_tokens, "
                         "in_flight, reserved_tokens, day_start, day_tokens, month_start, month_tokens) "
                         "SELECT id, 0, 0, 0, 0, 0, 0, 0, 0, 0 FROM tenants WHERE id = :tenant_id "
                         "ON CONFLICT (tenant_id) DO NOTHING"),
                    {"tenant_id": tenant_id},
                )  # fmt: skip
            row = (
                await session.execute(
                    select(Tenant, TenantUsage)
                    .outerjoin(TenantUsage, TenantUsage.tenant_id == Tenant.id)
                    .where(Tenant.id == tenant_id)
                )
            ).first()
        if row is None:
            from .errors import NotFoundError

            raise NotFoundError(f"no tenant with id {tenant_id}")
        return _live_usage(row[0], row[1], windows)


def _live_usage(tenant: Tenant, usage: TenantUsage | None, w: Windows) -> LiveUsage:
    from .models import tenant_quotas

    quotas = tenant_quotas(tenant)
    if usage is None:
        return LiveUsage(tenant.id, quotas)
    return LiveUsage(
        tenant.id, quotas,
        minute_requests=usage.minute_requests if usage.minute_start == w.minute else 0,
        minute_tokens=usage.minute_tokens if usage.minute_start == w.minute else 0,
        in_flight=usage.in_flight, reserved_tokens=usage.reserved_tokens,
        day_tokens=usage.day_tokens if usage.day_start == w.day else 0,
        month_tokens=usage.month_tokens if usage.month_start == w.month else 0,
    )  # fmt: skip


def _refusal(live: LiveUsage, cost: int, w: Windows) -> QuotaExceededError | None:
    """The quota that refuses a request of ``cost`` tokens now, or ``None`` (then retry)."""
    q = live.quotas
    if q.max_concurrent_chats is not None and live.in_flight + 1 > q.max_concurrent_chats:
        never = q.max_concurrent_chats == 0
        return QuotaExceededError("max_concurrent_chats", q.max_concurrent_chats, None, not never,
                                  f"{live.in_flight} chats already running")  # fmt: skip
    if q.requests_per_minute is not None and live.minute_requests + 1 > q.requests_per_minute:
        never = q.requests_per_minute == 0
        return QuotaExceededError("requests_per_minute", q.requests_per_minute,
                                  None if never else w.seconds_to_next_minute(), not never)  # fmt: skip
    checks = (
        ("tokens_per_minute", q.tokens_per_minute, live.minute_tokens, w.seconds_to_next_minute(), True),
        ("tokens_per_day", q.tokens_per_day, live.day_tokens, w.seconds_to_next_day(), False),
        ("tokens_per_month", q.tokens_per_month, live.month_tokens, w.seconds_to_next_month(), False),
    )
    for name, limit, used, reset_s, retryable in checks:
        if limit is None or used + cost <= limit:
            continue
        if cost > limit:  # can never fit, whatever the wait
            return QuotaExceededError(name, limit, None, False,
                                      f"the request may cost {cost} tokens (prompt + max_tokens), more than the limit")  # fmt: skip
        return QuotaExceededError(name, limit, reset_s, retryable,
                                  f"{used} used, this request may cost {cost} (prompt + max_tokens)")  # fmt: skip
    return None
