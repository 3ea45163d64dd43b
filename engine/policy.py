"""Scheduling policies: pure objects that order the queues; the scheduler keeps the mechanics.

A policy answers, without touching tensors:
- in which order waiting requests are admitted (``admission_order``);
- which running request is preempted when KV blocks run out (``choose_victim``);
- whether a waiting request may preempt a running one to get in (``outranks``);
and it is told when requests arrive, run tokens and finish, to keep its counters.

Priorities are integers, lower is more urgent (``PRIORITY_CLASSES``).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from typing import Iterable, Protocol

from engine.request import Request

PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}


class SchedulingPolicy(Protocol):
    name: str

    def admission_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """Waiting requests, most deserving first."""

    def choose_victim(self, candidates: list[Request], now: float) -> Request:
        """The request to preempt among ``candidates`` (non-empty)."""

    def outranks(self, request: Request, running: Request, now: float) -> bool:
        """Whether waiting ``request`` may preempt ``running`` to be admitted."""

    def on_arrival(self, request: Request, waiting: list[Request]) -> None:
        """``request`` joins the waiting queue ``waiting`` (not yet in it)."""

    def on_scheduled(self, request: Request, num_new_tokens: int, now: float) -> None:
        """``request`` computes ``num_new_tokens`` tokens this step (before its counter moves)."""

    def on_finished(self, request: Request) -> None: ...


class FCFSPolicy:
    """First come, first served: admit by arrival time; preempt the latest arrival.

    Priorities and tenants are ignored: the baseline for the other policies.
    """

    name = "fcfs"

    def admission_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def choose_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: r.arrival_time)

    def outranks(self, request: Request, running: Request, now: float) -> bool:
        return False

    def on_arrival(self, request: Request, waiting: list[Request]) -> None:
        pass

    def on_scheduled(self, request: Request, num_new_tokens: int, now: float) -> None:
        pass

    def on_finished(self, request: Request) -> None:
        pass


class PriorityFairPolicy:
    """Strict priority classes with aging, and tenant fairness inside a class.

    Between classes: a more urgent class is admitted first and may preempt a less
    urgent running request (at the block limit and at the sequence limit). Aging:
    a waiting request's effective class improves by one for every ``aging_s``
    seconds it has waited, so no class starves forever.

    Inside a class: the Virtual Token Counter of Sheng et al., "Fairness in
    Serving Large Language Models" (OSDI 2024). Each tenant's counter grows by
    ``(w_in * input tokens + w_out * output tokens) / weight`` as its tokens are
    computed (recomputation after a preemption is not charged again); the
    backlogged tenant with the lowest counter is admitted first. When a tenant
    becomes backlogged (it had no request waiting) its counter is lifted to the
    lowest counter among backlogged tenants (when none is, to the highest counter
    among tenants being served), so idle time is not banked. The preemption victim is the least urgent class's most-served
    tenant's latest request.

    Args:
        aging_s: seconds of class starvation per class of promotion; ``None``
            disables aging.
        w_in, w_out: costs of an input and an output token (the paper's default
            weighs output tokens more since they cost a step each).
        fair: use the counters inside a class (False: FCFS inside a class).
    """

    name = "priority-fair"

    def __init__(self, aging_s: float | None = 30.0, w_in: float = 1.0, w_out: float = 2.0, fair: bool = True) -> None:
        if aging_s is not None and aging_s <= 0:
            raise ValueError(f"aging_s must be > 0 or None, got {aging_s}")
        self.aging_s = aging_s
        self.w_in, self.w_out = w_in, w_out
        self.fair = fair
        self.counters: dict[str | None, float] = defaultdict(float)
        self.active: dict[str | None, int] = defaultdict(int)  # unfinished requests per tenant
        self._charged: dict[str, int] = {}  # request id -> tokens already charged
        # class -> since when it has waited without an admission (its starvation clock)
        self._starved_since: dict[int, float] = {}

    # -- classes ----------------------------------------------------------------
    def effective_class(self, request: Request, now: float) -> int:
        """The class a waiting request is ordered by (its own, less starvation promotions)."""
        since = self._starved_since.get(request.priority)
        if self.aging_s is None or since is None:
            return request.priority
        return max(0, request.priority - int((now - since) // self.aging_s))

    def outranks(self, request: Request, running: Request, now: float) -> bool:
        # Base classes only: aging reorders admission but never preempts, or an
        # overloaded class would preempt its own running requests as they age.
        return request.priority < running.priority

    # -- counters ---------------------------------------------------------------
    def on_arrival(self, request: Request, waiting: list[Request]) -> None:
        if not any(r.priority == request.priority for r in waiting):
            self._starved_since[request.priority] = request.arrival_time
        tenant = request.tenant_id
        backlogged = {r.tenant_id for r in waiting}  # the paper's backlog: requests in the queue
        if tenant not in backlogged:  # becomes backlogged: lift, so idle time is not banked
            if backlogged:
                floor = min(self.counters[t] for t in backlogged)
            else:  # empty queue: no credit over the tenants being served now
                floor = max((self.counters[t] for t, n in self.active.items() if n > 0), default=0.0)
            self.counters[tenant] = max(self.counters[tenant], floor)
        self.active[tenant] += 1

    def on_scheduled(self, request: Request, num_new_tokens: int, now: float) -> None:
        if request.request_id not in self._charged:  # admitted: its class is being served
            self._starved_since[request.priority] = now
        start = self._charged.get(request.request_id, 0)
        end = request.num_computed_tokens + num_new_tokens
        if end <= start:
            return  # recomputing what was already charged
        prompt = request.num_prompt_tokens
        n_in = max(0, min(end, prompt) - start)
        n_out = (end - start) - n_in
        self.counters[request.tenant_id] += (self.w_in * n_in + self.w_out * n_out) / request.weight
        self._charged[request.request_id] = end

    def on_finished(self, request: Request) -> None:
        self._charged.pop(request.request_id, None)
        tenant = request.tenant_id
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]

    # -- orders -------------------------------------------------------------------
    def admission_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        by_class: dict[int, list[Request]] = defaultdict(list)
        for r in waiting:
            by_class[self.effective_class(r, now)].append(r)
        order: list[Request] = []
        for cls in sorted(by_class):
            members = sorted(by_class[cls], key=lambda r: r.arrival_time)
            order.extend(self._fair_order(members) if self.fair else members)
        return order

    def _fair_order(self, members: list[Request]) -> list[Request]:
        """Interleave tenants by lowest (simulated) counter, FCFS within a tenant.

        A heap over tenants keeps this O(n log T) for n requests of T tenants.
        """
        queues: dict[str | None, deque[Request]] = defaultdict(deque)
        for r in members:  # members are in arrival order
            queues[r.tenant_id].append(r)
        heap = [(self.counters[t], q[0].arrival_time, i, t) for i, (t, q) in enumerate(queues.items())]
        heapq.heapify(heap)
        order = []
        while heap:
            sim, _, i, tenant = heapq.heappop(heap)
            q = queues[tenant]
            r = q.popleft()
            order.append(r)
            if q:
                remaining = max(0, r.num_prompt_tokens - self._charged.get(r.request_id, 0))
                heapq.heappush(heap, (sim + self.w_in * remaining / r.weight, q[0].arrival_time, i, tenant))
        return order

    def choose_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (r.priority, self.counters[r.tenant_id], r.arrival_time))


POLICIES = {
    "fcfs": FCFSPolicy,
    "priority": lambda: PriorityFairPolicy(fair=False),
    "fair": lambda: PriorityFairPolicy(aging_s=None),
    "priority-fair": PriorityFairPolicy,
}


def make_policy(name: str, **options) -> SchedulingPolicy:
    """Build a policy by name: ``fcfs``, ``priority`` (classes, FCFS inside),
    ``fair`` (VTC only), ``priority-fair`` (the default: classes with VTC inside).

    Raises:
        ValueError: unknown name or bad option.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")
    if options:
        if name == "fcfs":
            raise ValueError("fcfs takes no options")
        base = {"priority": {"fair": False}, "fair": {"aging_s": None}}.get(name, {})
        return PriorityFairPolicy(**{**base, **options})
    return POLICIES[name]()
