"""Continuous batching: which requests compute how many tokens in the next step.

The step follows vLLM v1's unified view (no separate prefill and decode phases):
every request has ``num_computed_tokens`` and ``num_tokens``; a step gives each
scheduled request ``num_new_tokens`` of its uncomputed tokens under a token budget
(``max_num_batched_tokens``) and a sequence limit (``max_num_seqs``). Order of
service: running requests (decodes and unfinished prefill chunks), then swapped
requests coming back, then waiting ones in the policy's order, each starting from
its longest prefix-cache hit. A long prompt is split across steps (chunked
prefill, as in Agrawal et al., "Sarathi-Serve", OSDI 2024) so running decodes keep
flowing. When blocks run out, the policy's victim is preempted: swapped to the
CPU pool or freed for recompute (vLLM's two modes), per ``preemption_mode``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.policy import SchedulingPolicy
from engine.request import Request, RequestStatus

PREEMPTION_MODES = ("swap", "recompute", "auto")
# A waiting request that does not fit may be overtaken by smaller ones behind it,
# but only this many steps in a row; then nothing behind it is admitted until it fits.
HEAD_OF_LINE_SKIP_LIMIT = 64


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")


@dataclass
class PreemptionCostModel:
    """Chooses swap or recompute for a victim in ``auto`` mode.

    Swap costs moving the blocks out and back: ``2 * blocks * bytes_per_block /
    copy_bandwidth`` seconds. Recompute costs prefilling the computed tokens
    again: ``tokens / prefill_rate`` seconds. The engine keeps both rates
    measured (bytes/s, tokens/s).
    """

    bytes_per_block: int = 1
    copy_bandwidth: float = 1e10
    prefill_rate: float = 1e4

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        swap_s = 2 * num_blocks * self.bytes_per_block / self.copy_bandwidth
        recompute_s = num_tokens / self.prefill_rate
        return swap_s < recompute_s


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
    """The plan for one step; plain data, no tensors.

    The runner performs ``blocks_to_swap_out`` (gpu -> cpu) first, then
    ``blocks_to_swap_in`` (cpu -> gpu), then the model step.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


class Scheduler:
    """Owns the waiting, running and swapped queues and the block manager's use."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        policy: SchedulingPolicy,
        cost_model: PreemptionCostModel | None = None,
        clock=time.monotonic,
    ) -> None:
        self.clock = clock  # seconds; simulations pass a virtual clock
        self.config = config
        self.block_manager = block_manager
        self.policy = policy
        self.cost_model = cost_model or PreemptionCostModel()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = 0
        self._skips: dict[int, int] = {}  # id(request) -> steps overtaken in a row

    # -- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.policy.on_arrival(request, self.waiting)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove ``request`` from its queue, free its blocks and mark it finished."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
                self.policy.on_finished(request)
                break
        self._skips.pop(id(request), None)
        self.block_manager.free(request)
        request.status = status
        request.finished_time = self.clock()

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
            if ok:
                scheduled[id(request)] = ScheduledRequest(request, n)
                budget -= n

        # A preemption means the pool is full: bringing anything in would thrash.
        if not out.preempted:
            budget = self._resume_swapped(budget, scheduled, out)
        if not out.preempted:
            # Swapped requests resume before new ones, unless a new one outranks them all.
            self._admit_waiting(budget, scheduled, out, blockers=list(self.swapped))

        now = self.clock()
        for plan in scheduled.values():
            self.policy.on_scheduled(plan.request, plan.num_new_tokens, now)
        out.scheduled = list(scheduled.values())
        return out

    def _resume_swapped(self, budget: int, scheduled: dict, out: SchedulerOutput) -> int:
        bm = self.block_manager
        now = self.clock()
        for request in self.policy.admission_order(self.swapped, now):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not bm.can_swap_in(request, n):
                break
            out.blocks_to_swap_in.extend(bm.swap_in(request))
            grown = bm.allocate_slots(request, n)  # can_swap_in checked the room for these slots
            assert grown, "swap-in without room for the step's slots"
            self.swapped.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            scheduled[id(request)] = ScheduledRequest(request, n)
            budget -= n
        return budget

    def _admit_waiting(self, budget: int, scheduled: dict, out: SchedulerOutput, blockers: list[Request]) -> None:
        bm = self.block_manager
        now = self.clock()
        for request in self.policy.admission_order(self.waiting, now):
            if budget <= 0:
                break
            if blockers and not all(self.policy.outranks(request, b, now) for b in blockers):
                continue
            if len(self.running) >= self.config.max_num_seqs:
                # At the sequence limit only a more urgent request gets in, by preemption.
                returned = self._preempt_for(request, scheduled, out, now)
                if returned is None:
                    break
                budget += returned
            hit = bm.match_prefix(request)
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, budget)
            chunk_ok = n == remaining or self.config.enable_chunked_prefill
            fits = chunk_ok and bm.allocate_slots(request, n)
            while chunk_ok and not fits:  # blocks short: preempt less urgent requests, if any
                returned = self._preempt_for(request, scheduled, out, now)
                if returned is None:
                    break
                budget += returned
                fits = bm.allocate_slots(request, n)
            if not fits:
                bm.free(request)  # undo the prefix match; the hit blocks stay cached
                request.num_computed_tokens = 0
                skips = self._skips.get(id(request), 0) + 1
                self._skips[id(request)] = skips
                if skips > HEAD_OF_LINE_SKIP_LIMIT:
                    break  # it has waited long enough: nothing more overtakes it
                continue
            bm.record_prefix_query(request.num_tokens, hit)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = hit
            self._skips.pop(id(request), None)
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            scheduled[id(request)] = ScheduledRequest(request, n)
            budget -= n

    def _preempt_for(self, request: Request, scheduled: dict, out: SchedulerOutput, now: float) -> int | None:
        """Preempt one running request that waiting ``request`` outranks.

        Returns:
            the budget the victim's withdrawn plan gives back, or None if no
            running request is outranked.
        """
        candidates = [
            r for r in self.running
            if r.status == RequestStatus.RUNNING and self.policy.outranks(request, r, now)
        ]
        if not candidates:
            return None
        victim = self.policy.choose_victim(candidates, now)
        plan = scheduled.pop(id(victim), None)
        self._preempt(victim, out)
        return plan.num_new_tokens if plan is not None else 0

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
            victim = self.policy.choose_victim(candidates, self.clock())
            plan = scheduled.pop(id(victim), None)
            if plan is not None:
                returned += plan.num_new_tokens
            self._preempt(victim, out)
            if victim is request:
                return False, returned
        return True, returned

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Swap the victim out or free it for recompute; it keeps its tokens and its place in line."""
        bm = self.block_manager
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        if self._should_swap(request):
            out.blocks_to_swap_out.extend(bm.swap_out(request))
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
        else:
            bm.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.append(request)

    def _should_swap(self, request: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.block_manager.can_swap_out(request):
            return False  # recompute is also the fallback when the CPU pool is full
        if mode == "swap":
            return True
        return self.cost_model.prefer_swap(len(request.block_table), request.num_computed_tokens)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advance the computed-token counters of the requests that ran, and cache their full blocks."""
        for plan in output.scheduled:
            plan.request.num_computed_tokens += plan.num_new_tokens
            self.block_manager.cache_computed_blocks(plan.request)
