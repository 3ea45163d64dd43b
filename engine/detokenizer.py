"""Incremental detokenization with stop strings.

Text is produced the way vLLM's incremental detokenizer does it: decode a short
window of recent tokens twice (with and without the newest) and emit the
difference, holding it back while it ends in U+FFFD (an incomplete UTF-8
sequence from byte-fallback or byte-level tokens). Stop strings are searched in
the full output text; text that could still grow into a stop string is held
back, so a stop string that spans tokens is never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Tokens decoded before the new ones, for context-dependent decoders (e.g. a
# SentencePiece leading space depends on its neighbour).
_PREFIX_WINDOW = 6


@dataclass
class IncrementalDetokenizer:
    """Per-request text state.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` is what is used).
        prompt_token_ids: the prompt, giving the first decoding context.
        stop: stop strings.
        skip_special_tokens: omit special tokens (e.g. ``<|im_end|>``) from text.
    """

    tokenizer: object
    prompt_token_ids: list[int]
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    output_text: str = ""  # all decoded text (may run past the stop point before truncation)
    emitted: int = 0  # characters of output_text already returned to the caller
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_by: str | None = None

    def __post_init__(self) -> None:
        context = self.prompt_token_ids[-_PREFIX_WINDOW:]
        self.token_ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append one generated token.

        Returns:
            True when a stop string now appears in the text (the text is cut
            before it and generation must stop).
        """
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new_text = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            # Keep the window short so each step decodes O(1) tokens.
            start = len(self.output_text)
            self.output_text += new_text
            return self._check_stop(start)
        return False

    def _check_stop(self, new_start: int) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, new_start - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.output_text.find(s, search_from)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.output_text = self.output_text[:index]
        self.stopped_by = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while unfinished, withhold a tail that may begin a stop string."""
        end = len(self.output_text)
        if not finished and self.stop:
            end -= self._partial_stop_len()
        end = max(end, self.emitted)
        delta = self.output_text[self.emitted : end]
        self.emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.output_text
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
