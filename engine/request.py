"""A request's state inside the engine: its tokens, counters and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every finished state compares ``>= FINISHED_STOPPED``."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One generation request.

    ``token_ids`` holds prompt then output tokens. ``num_computed_tokens`` counts
    the leading tokens whose K/V are in the cache; the scheduler advances it, and
    preemption by recompute resets it. ``block_table`` lists the KV block ids that
    hold tokens ``[i * block_size, (i + 1) * block_size)``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tenant_id: str | None = None
    priority: int = 1  # lower is more urgent: interactive=0, standard=1, batch=2
    weight: float = 1.0  # the tenant's fair-share weight
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # CPU swap-pool blocks while SWAPPED (same order as block_table had).
    cpu_block_table: list[int] = field(default_factory=list)
    # Prefix-cache keys of the leading full, computed blocks of block_table.
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None  # first admission: queue time ends here
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_token_time: float | None = None
    finished_time: float | None = None
    generator: torch.Generator | None = field(default=None, repr=False)
    # Counts of generated tokens for presence/frequency penalties: survives preemption.
    output_counts: dict[int, int] = field(default_factory=dict, repr=False)
    # Per generated token (logprob, top-n dict) when the params ask for logprobs.
    logprobs: list | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def check_stop_token(self) -> RequestStatus | None:
        """Finish status implied by the last token and the length limits, if any."""
        last = self.token_ids[-1]
        params = self.sampling_params
        if not params.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
