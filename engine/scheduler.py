"""Continuous batching: which requests compute how many tokens in the next step.

The step follows vLLM v1's unified view (no separate prefill and decode phases):
every request has ``num_computed_tokens`` and ``num_tokens``; a step gives each
scheduled request ``num_new_tokens`` of its uncomputed tokens under a token budget
(``max_num_batched_tokens``) and a sequence limit (``max_num_seqs``). Running
requests go first (decodes and unfinished prefill chunks), then waiting ones in
the policy's order. A long prompt is split across steps (chunked prefill, as in
Agrawal et al., "Sarathi-Serve", OSDI 2024) so that running decodes keep flowing.
When blocks run out, the policy's victim is preempted and recomputed later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.policy import SchedulingPolicy
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    """The plan for one step; plain data, no tensors."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and the block manager's use."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: SchedulingPolicy) -> None:
        self.config = config
        self.block_manager = block_manager
        self.policy = policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove ``request`` from its queue, free its blocks and mark it finished."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.finished_time = time.monotonic()

    # -- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, ScheduledRequest] = {}  # id(request) -> plan

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            ok, returned = self._allocate_or_preempt(request, n, scheduled, out)
            budget += returned
            if not ok:
                continue
            scheduled[id(request)] = ScheduledRequest(request, n)
            budget -= n

        # New admissions only when nothing had to be preempted this step: a
        # preemption means the pool is full, and admitting would thrash.
        if not out.preempted:
            now = time.monotonic()
            for request in self.policy.admission_order(self.waiting, now):
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                remaining = request.num_tokens - request.num_computed_tokens
                n = min(remaining, budget)
                if n < remaining and not self.config.enable_chunked_prefill:
                    break
                if not self.block_manager.allocate_slots(request, n):
                    break  # keep the policy's order: no request overtakes the head
                self.waiting.remove(request)
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                scheduled[id(request)] = ScheduledRequest(request, n)
                budget -= n

        for plan in scheduled.values():
            self.policy.on_scheduled(plan.request, plan.num_new_tokens)
        out.scheduled = list(scheduled.values())
        return out

    def _allocate_or_preempt(
        self,
        request: Request,
        n: int,
        scheduled: dict[int, ScheduledRequest],
        out: SchedulerOutput,
    ) -> tuple[bool, int]:
        """Allocate slots for ``request``, preempting the policy's victims until they fit.

        Returns:
            ``(ok, returned_budget)``: ok is False when ``request`` itself was the
            victim; returned_budget is the tokens of victims that had already been
            scheduled this step (their plans are withdrawn).
        """
        returned = 0
        while not self.block_manager.allocate_slots(request, n):
            candidates = [r for r in self.running if r.status == RequestStatus.RUNNING]
            victim = self.policy.choose_victim(candidates)
            plan = scheduled.pop(id(victim), None)
            if plan is not None:
                returned += plan.num_new_tokens
            self._preempt(victim, out)
            if victim is request:
                return False, returned
        return True, returned

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: free the blocks, keep the tokens, wait again in arrival order."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.append(request)
        self.num_preemptions += 1
        out.preempted.append(request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advance the computed-token counters of the requests that ran."""
        for plan in output.scheduled:
            plan.request.num_computed_tokens += plan.num_new_tokens
