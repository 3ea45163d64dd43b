"""Batched next-token selection from logits.

Order of processing for each row (documented because results depend on it):
1. penalties on the raw logits: repetition (CTRL, Keskar et al. 2019: divide a
   positive logit / multiply a negative one by the penalty for every token seen in
   prompt or output), then frequency and presence (OpenAI: subtract
   ``frequency * count + presence * [count > 0]`` over generated tokens);
2. greedy rows (temperature 0 or top_k 1) take the argmax;
3. other rows: divide by temperature, keep the top-k, then the top-p nucleus
   (Holtzman et al., 2020: the smallest set of most likely tokens whose mass
   reaches ``top_p``), then min-p (Nguyen et al., 2024: tokens with probability
   at least ``min_p`` times the most likely one's), renormalise, and sample by
   the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, which equals drawing
   from ``p``. A seeded request draws ``E`` from its own generator, so its
   tokens do not depend on what else is in the batch.

Logprobs, when asked for, are the model's log-softmax before any processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or (sampled token's logprob, {token_id: logprob} of the top-n).
    logprobs: list[tuple[float, dict[int, float]] | None]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Apply repetition/presence/frequency penalties in place; ``logits`` is ``(N, V)`` fp32."""
    for i, r in enumerate(requests):
        p = r.sampling_params
        if not p.needs_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_counts and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(list(r.output_counts), dtype=torch.long, device=row.device)
            counts = torch.tensor(list(r.output_counts.values()), dtype=row.dtype, device=row.device)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to ``-inf``) the tokens that top-k, top-p and min-p drop.

    Args:
        logits: ``(N, V)`` fp32, already divided by the temperature.
        top_k: ``(N,)`` int64; ``<= 0`` disables.
        top_p: ``(N,)`` fp32 in ``(0, 1]``; ``1`` disables.
        min_p: ``(N,)`` fp32 in ``[0, 1]``; ``0`` disables.

    Returns:
        ``(N, V)`` fp32 filtered logits (a new tensor).
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (N, V)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # (1, V)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (N, V)
    # top_p == 1 must keep everything, even where fp32 cumsum rounds past 1.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


class Sampler:
    """Chooses one token per row.

    Args:
        generator: draws for requests without a seed (seeded by the engine).
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample.

        Args:
            logits: ``(N, V)`` float32, row ``i`` for ``requests[i]``; modified in place.
            requests: the requests being sampled, with their params and tokens.

        Returns:
            one token id per row, and logprobs where asked for.
        """
        logprobs = self._logprobs(logits, requests)
        apply_penalties(logits, requests)
        params = [r.sampling_params for r in requests]
        tokens = logits.argmax(dim=-1)  # (N,)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            sub = logits[rows]
            temps = torch.tensor([params[i].temperature for i in sampled_rows], device=logits.device)
            sub = sub / temps.unsqueeze(1)
            sub = filter_logits(
                sub,
                torch.tensor([params[i].top_k for i in sampled_rows], device=logits.device),
                torch.tensor([params[i].top_p for i in sampled_rows], device=logits.device),
                torch.tensor([params[i].min_p for i in sampled_rows], device=logits.device),
            )
            probs = sub.softmax(dim=-1)
            noise = self._exponential_noise([requests[i] for i in sampled_rows], probs.shape[1])
            tokens[rows] = (probs / noise.to(probs.device)).argmax(dim=-1)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=self._pick_logprobs(logprobs, tokens, requests))

    def _exponential_noise(self, requests: list[Request], vocab: int) -> torch.Tensor:
        noise = torch.empty((len(requests), vocab))
        for i, r in enumerate(requests):
            noise[i].exponential_(generator=r.generator or self.generator)
        return noise

    @staticmethod
    def _logprobs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
        if all(r.sampling_params.logprobs is None for r in requests):
            return None
        return logits.log_softmax(dim=-1)

    @staticmethod
    def _pick_logprobs(logprobs, tokens, requests):
        if logprobs is None:
            return [None] * len(requests)
        out: list[tuple[float, dict[int, float]] | None] = []
        for i, r in enumerate(requests):
            n = r.sampling_params.logprobs
            if n is None:
                out.append(None)
                continue
            top = logprobs[i].topk(n) if n > 0 else None
            top_dict = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
            out.append((float(logprobs[i, tokens[i]]), top_dict))
        return out
