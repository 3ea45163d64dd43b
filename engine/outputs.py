"""What the engine returns for a request, step by step and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        text: all text so far (final text once finished).
        token_ids: all generated token ids so far (an EOS or stop token included).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None.
        delta_text: text new since the previous output of this request.
        delta_token_ids: token ids new since the previous output.
        logprobs: per generated token, ``(logprob, {token_id: logprob})`` when asked.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """Timestamps in ``time.monotonic()`` seconds."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first admission."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens that were prefix-cache hits
