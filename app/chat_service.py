"""The one path every chat takes, whatever the transport (WebSocket, OpenAI SSE, ...).

``ChatService.run`` checks the priority class, reserves the request's maximum
cost against the tenant's quotas (one atomic SQL statement, ``tenancy.quotas``)
before the engine sees it, streams the engine's outputs, and settles the
reservation to the real token counts however the stream ends: finished
(``stop``/``length``), cancelled, closed by the consumer (disconnect), engine
error or any exception. Settlement runs shielded from cancellation and is
retried while the database is briefly unavailable.

Usage (a transport)::

    service = ChatService(llm, store, settings)
    stream = service.run(principal, request_id, prompt_ids, params, "interactive")
    async with contextlib.aclosing(stream):
        async for out in stream:          # engine.RequestOutput, as from AsyncLLM.generate
            send(out.outputs[0].delta_text)

Refusals raise from the FIRST ``__anext__`` (before any output, so an HTTP
transport can still choose its status code): ``PriorityNotAllowedError``,
``QuotaExceededError``, ``StoreUnavailableError`` (the store is down; nothing was
reserved), or the engine's ``InvalidRequestError``. Always close the stream
(``aclosing``, or ``await stream.aclose()``): closing is what aborts the
request in the engine and settles the quota at once; an unclosed stream is
only settled when it is garbage-collected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tenancy.errors import PriorityNotAllowedError, QuotaExceededError, StoreUnavailableError
from tenancy.quotas import Reservation, Settlement
from tenancy.records import PRIORITY_CLASSES

__all__ = [
    "PRIORITY_LEVELS",
    "ChatService",
    "PriorityNotAllowedError",
    "QuotaExceededError",
    "StoreUnavailableError",
    "default_priority",
]

log = logging.getLogger("chatgate.chat")

# The engine's integer per class name: lower is more urgent.
PRIORITY_LEVELS: dict[str, int] = {name: level for level, name in enumerate(PRIORITY_CLASSES)}
# Waits between settlement attempts while the store is unavailable (seconds).
SETTLE_BACKOFF_S = (0.05, 0.25, 1.0, 3.0, 10.0)


def default_priority(principal: Any) -> str:
    """``standard`` when the tenant may use it, else its most urgent allowed class."""
    allowed = principal.allowed_priorities
    return "standard" if "standard" in allowed else min(allowed, key=PRIORITY_LEVELS.__getitem__)


class ChatService:
    """Quota-checked chat generation over an engine client.

    Args:
        llm: the engine client (``engine.AsyncLLM`` or a wrapper with the same
            ``generate(prompt_ids, params, request_id, *, tenant_id, priority, weight)``
            and ``abort(request_id)``).
        store: the ``tenancy.TenancyStore`` whose ``quotas`` ledger reserves and
            settles; ``None`` runs unmetered (priority checks only; for tests of
            the transport alone, never for a served gateway).
        settings: ``app.settings.Settings`` (not read yet; kept for future knobs).
        clock: monotonic seconds, for the timings in usage rows.
    """

    def __init__(self, llm: Any, store: Any | None, settings: Any = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.llm = llm
        self.store = store
        self.settings = settings
        self._clock = clock
        self._pending: set[asyncio.Task] = set()
        self._listeners: list[Callable[[Reservation, Settlement], None]] = []

    def add_listener(self, listener: Callable[[Reservation, Settlement], None]) -> None:
        """Call ``listener(reservation, settlement)`` after every settlement (e.g. metrics)."""
        self._listeners.append(listener)

    def check_priority(self, principal: Any, priority_class: str | None) -> str:
        """The class to run at: ``priority_class``, or the tenant's default when ``None``.

        Raises:
            PriorityNotAllowedError: an unknown class, or one the tenant may not use.
        """
        priority = priority_class or default_priority(principal)
        if priority not in principal.allowed_priorities:
            allowed = sorted(principal.allowed_priorities, key=PRIORITY_LEVELS.__getitem__)
            raise PriorityNotAllowedError(priority, allowed)
        return priority

    async def run(
        self, principal: Any, request_id: str, prompt_token_ids: list[int], params: Any, priority_class: str | None
    ) -> AsyncIterator[Any]:
        """Stream one chat's ``engine.RequestOutput``s under the tenant's quotas.

        Args:
            principal: the authenticated ``tenancy.Principal``.
            request_id: unique among running requests (it is also the engine's id).
            prompt_token_ids: the tokenized conversation.
            params: ``engine.SamplingParams``; its ``max_tokens`` is the reserved
                output budget, so cap it to the context room first.
            priority_class: ``interactive``, ``standard``, ``batch``, or ``None``
                for the tenant's default.

        Raises (from the first ``__anext__``, nothing reserved):
            PriorityNotAllowedError, QuotaExceededError, StoreUnavailableError,
            engine.InvalidRequestError (then the reservation is settled at 0).
        Later engine failures pass through after settlement; an output with
        ``finish_reason == "error"`` is yielded as is.
        """
        priority = self.check_priority(principal, priority_class)
        reservation = None
        if self.store is not None:
            reservation = await self._reserve(principal, request_id, priority, len(prompt_token_ids), params.max_tokens)
        started = self._clock()
        last = None
        finish = "abort"
        stream = None
        failed = False
        try:
            stream = self.llm.generate(
                prompt_token_ids, params, request_id, tenant_id=str(principal.tenant_id),
                priority=PRIORITY_LEVELS[priority], weight=principal.weight,
            )  # fmt: skip
            async for out in stream:
                last = out
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise  # chat.cancel, disconnect, or the consumer closed the stream: "abort"
        except BaseException:
            failed = True
            raise
        finally:
            if last is not None and last.finished:
                finish = last.outputs[0].finish_reason or "stop"
            elif failed:
                finish = "error"
            try:
                if stream is not None and hasattr(stream, "aclose"):
                    await stream.aclose()  # aborts the request in the engine unless it finished
                if last is None or not last.finished:
                    await self.llm.abort(request_id)
            finally:
                if reservation is not None:
                    await self._settle(reservation, _settlement(last, finish, started, self._clock()))

    async def drain(self, timeout_s: float = 15.0) -> None:
        """Wait for settlements still running in the background (call before closing the store)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout_s)

    async def _reserve(self, principal: Any, request_id: str, priority: str, prompt_tokens: int,
                       max_tokens: int) -> Reservation:  # fmt: skip
        # Shielded: a cancel landing after the UPDATE committed but before we hold the
        # Reservation would leak it; instead the orphan is settled at zero cost.
        task = asyncio.ensure_future(self.store.quotas.reserve(
            principal.tenant_id, principal.key_id, request_id, priority, prompt_tokens, max_tokens
        ))  # fmt: skip
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        orphan = Settlement(0, "abort", None, 0.0, charged_prompt=False)
        settle = asyncio.ensure_future(self._settle_with_retries(task.result(), orphan))
        self._pending.add(settle)
        settle.add_done_callback(self._pending.discard)

    async def _settle(self, reservation: Reservation, outcome: Settlement) -> None:
        # A task of its own, awaited through a shield: a second cancellation of the
        # caller (or an aclose at garbage collection) cannot stop it half-way.
        task = asyncio.ensure_future(self._settle_with_retries(reservation, outcome))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        await asyncio.shield(task)

    async def _settle_with_retries(self, reservation: Reservation, outcome: Settlement) -> None:
        for attempt, wait_s in enumerate((*SETTLE_BACKOFF_S, None)):
            try:
                await self.store.quotas.settle(reservation, outcome)
                break
            except StoreUnavailableError as exc:
                if wait_s is None:
                    log.error("request %s: settlement lost after %d attempts (%s); tenant %d keeps "
                              "%d reserved tokens and one concurrent slot", reservation.request_id,
                              attempt + 1, exc, reservation.tenant_id, reservation.cost)  # fmt: skip
                    return
                await asyncio.sleep(wait_s)
            except Exception:  # noqa: BLE001 - never let accounting break a chat
                log.exception("request %s: settlement failed", reservation.request_id)
                return
        for listener in self._listeners:
            try:
                listener(reservation, outcome)
            except Exception:  # noqa: BLE001
                log.exception("settlement listener failed")


def _settlement(last: Any, finish: str, started: float, ended: float) -> Settlement:
    """The real cost: the prompt once the engine produced anything, plus every token produced."""
    completion = last.outputs[0] if last is not None else None
    metrics = getattr(last, "metrics", None)
    arrival = getattr(metrics, "arrival_time", None)
    first = getattr(metrics, "first_token_time", None)
    ttft_ms = (first - arrival) * 1000.0 if arrival is not None and first is not None else None
    return Settlement(
        completion_tokens=len(completion.token_ids) if completion is not None else 0,
        finish_reason=finish,
        ttft_ms=ttft_ms,
        total_ms=(ended - started) * 1000.0,
        charged_prompt=last is not None,
    )
