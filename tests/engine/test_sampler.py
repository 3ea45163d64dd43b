"""Sampling: seeded reproducibility, greedy equivalences, exact top-p / min-p sets."""

from __future__ import annotations

import math

import pytest
import torch

from engine import SamplingParams
from engine.llm import LLM
from engine.sampler import Sampler, apply_penalties, filter_logits
from engine.request import Request
from tests.engine.tiny_models import engine_for, make_hf_model


@pytest.fixture(scope="module")
def hf():
    return make_hf_model("gqa_tied")


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20]


def _run(hf, params, prompts=PROMPTS, seed=0):
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4, seed=seed))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(hf):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _run(hf, params, [PROMPTS[0]])[0]
    batched = _run(hf, params)[0]
    other_engine_seed = _run(hf, params, seed=99)[0]
    assert alone == batched == other_engine_seed
    different_seed = _run(hf, SamplingParams(temperature=1.0, seed=4321, max_tokens=20, ignore_eos=True), [PROMPTS[0]])[0]
    assert different_seed != alone


def test_unseeded_sampling_follows_the_engine_seed(hf):
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    assert _run(hf, params, seed=7) == _run(hf, params, seed=7)
    assert _run(hf, params, seed=7) != _run(hf, params, seed=8)


def test_top_k_one_and_temperature_zero_equal_greedy(hf):
    greedy = _run(hf, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    top1 = _run(hf, SamplingParams(temperature=1.5, top_k=1, max_tokens=15, ignore_eos=True, seed=3))
    assert greedy == top1
    # A near-zero temperature without top_k samples from a distribution that is all but one-hot.
    sharp = _run(hf, SamplingParams(temperature=1e-4, max_tokens=15, ignore_eos=True, seed=3))
    assert sharp == greedy


def _kept(logits, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    out = filter_logits(
        logits.unsqueeze(0).clone(),
        torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]),
    )[0]
    return set(torch.nonzero(out > float("-inf")).flatten().tolist())


# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 on tokens 3, 0, 4, 1, 2
PROBS = torch.tensor([0.3, 0.1, 0.05, 0.4, 0.15])
LOGITS = PROBS.log()


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(1.0, {0, 1, 2, 3, 4}), (0.4, {3}), (0.41, {3, 0}), (0.7, {3, 0}), (0.71, {3, 0, 4}), (0.9, {3, 0, 4, 1}), (0.95, {3, 0, 4, 1}), (0.96, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p, expected):
    assert _kept(LOGITS, top_p=top_p) == expected


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, {0, 1, 2, 3, 4}), (0.2, {3, 0, 4, 1}), (0.26, {3, 0, 4}), (0.5, {3, 0}), (0.76, {3}), (1.0, {3})],
)
def test_min_p_keeps_tokens_above_the_scaled_top_probability(min_p, expected):
    assert _kept(LOGITS, min_p=min_p) == expected


def test_top_k_then_top_p_renormalises():
    # Top-2 leaves 0.4 and 0.3 -> renormalised 4/7 and 3/7; top_p 0.5 keeps only token 3.
    assert _kept(LOGITS, top_k=2, top_p=0.5) == {3}
    assert _kept(LOGITS, top_k=2, top_p=0.6) == {3, 0}


def test_sampling_draws_only_kept_tokens_with_right_frequencies():
    sampler = Sampler(torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.71)
    reqs = [Request(str(i), [1], params) for i in range(4000)]
    tokens = sampler(LOGITS.repeat(len(reqs), 1), reqs).token_ids
    counts = {t: tokens.count(t) for t in set(tokens)}
    assert set(counts) == {3, 0, 4}
    # 0.4 / 0.85 of draws should be token 3
    assert abs(counts[3] / len(tokens) - 0.4 / 0.85) < 0.03


def test_penalties_follow_their_definitions():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    r = Request("r", [0, 1], params)
    r.append_output_token(1)
    r.append_output_token(1)
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(logits, [r])
    # token 0: seen in prompt, positive -> /2; token 1: seen, negative -> *2, then -0.5 - 2*0.25
    assert logits[0].tolist() == pytest.approx([1.0, -4.0 - 0.5 - 0.5, 1.0, 0.5])


def test_logprobs_are_the_models_log_softmax(hf):
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4))
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    for token, (lp, top) in zip(out.outputs[0].token_ids, lps):
        assert len(top) == 2
        assert max(top.values()) == pytest.approx(lp)  # greedy picks the top token
        assert top[token] == pytest.approx(lp)
        assert lp <= 0 and math.isfinite(lp)
