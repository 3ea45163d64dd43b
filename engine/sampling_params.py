"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and meanings).

    Attributes:
        temperature: softmax temperature; ``0`` means greedy. Finite, ``>= 0``.
        top_p: nucleus sampling mass in ``(0, 1]``; ``1`` disables.
        top_k: keep the ``k`` most likely tokens; ``-1`` or ``0`` disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top
            token's; ``0`` disables. In ``[0, 1]``.
        max_tokens: the most tokens to generate, ``>= 1``.
        stop: strings that end generation; never emitted themselves.
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past the model's EOS tokens.
        seed: seeds a per-request generator, so sampling is reproducible
            whatever else is batched with it.
        repetition_penalty: CTRL-style (Keskar et al., 2019) multiplicative
            penalty on tokens seen in prompt or output; ``1`` disables, ``> 0``.
        presence_penalty, frequency_penalty: OpenAI-style additive penalties
            on generated tokens, in ``[-2, 2]``.
        logprobs: number of top log-probabilities to return per token
            (``None`` for none), ``0..20``.

    Raises:
        InvalidRequestError: any value out of range, naming the parameter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists (and a lone string) from callers; store tuples so params stay hashable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {why}", code="invalid_parameter")

        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise bad("temperature", f"must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):  # NaN fails this too
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", f"must be finite and > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be in 0..20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
