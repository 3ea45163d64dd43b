"""Scheduling policies: pure objects that order the queues; the scheduler keeps the mechanics.

A policy answers two questions and touches no tensors:
- in which order waiting requests are admitted (``admission_order``);
- which running request is preempted when KV blocks run out (``choose_victim``).
"""

from __future__ import annotations

from typing import Iterable, Protocol

from engine.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def admission_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """Waiting requests, most deserving first."""

    def choose_victim(self, candidates: list[Request]) -> Request:
        """The request to preempt among ``candidates`` (non-empty)."""

    def on_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """Bookkeeping hook: ``request`` computes ``num_new_tokens`` tokens this step."""


class FCFSPolicy:
    """First come, first served: admit by arrival time; preempt the latest arrival.

    Priorities are ignored, which makes this the baseline for the priority and
    fairness policies.
    """

    name = "fcfs"

    def admission_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def choose_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: r.arrival_time)

    def on_scheduled(self, request: Request, num_new_tokens: int) -> None:
        pass


class PriorityPolicy:
    """Strict priority (lower value first), FCFS inside a class.

    The victim is the lowest-priority request, the latest arrival among equals.
    """

    name = "priority"

    def admission_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))

    def choose_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))

    def on_scheduled(self, request: Request, num_new_tokens: int) -> None:
        pass


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    """Build a policy by name.

    Raises:
        ValueError: unknown name.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
