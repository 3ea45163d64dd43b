"""Greedy decoding equals transformers' token for token on tiny random Llama models."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.llm import LLM
from tests.engine.tiny_models import TINY_CONFIGS, engine_for, hf_greedy_ids, make_hf_model

MAX_NEW = 12


def _prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 48, 5][:n]  # includes exact multiples of the block size
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def hf_and_refs(request):
    hf = make_hf_model(request.param)
    prompts = _prompts(hf.config.vocab_size)
    refs = [hf_greedy_ids(hf, p, MAX_NEW) for p in prompts]
    return hf, prompts, refs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _generate(hf, prompts, **engine_kwargs):
    llm = LLM.from_engine(engine_for(hf, **engine_kwargs))
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["free_gpu_blocks"] == llm.stats()["total_gpu_blocks"]
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_eight_prompts_matches_transformers(hf_and_refs):
    hf, prompts, refs = hf_and_refs
    assert _generate(hf, prompts, num_gpu_blocks=128, block_size=16) == refs


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_sizes_match_transformers(hf_and_refs, block_size):
    hf, prompts, refs = hf_and_refs
    assert _generate(hf, prompts, num_gpu_blocks=2048 // block_size, block_size=block_size) == refs


@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_chunked_prefill_matches_transformers(hf_and_refs, budget):
    hf, prompts, refs = hf_and_refs
    assert _generate(hf, prompts, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=budget) == refs


def test_preemption_by_recompute_matches_transformers(hf_and_refs):
    hf, prompts, refs = hf_and_refs
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=16, block_size=4))
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.stats()["num_preemptions"] > 0, "the tiny pool should have forced preemption"


def test_requests_added_mid_generation_match_transformers(hf_and_refs):
    hf, prompts, refs = hf_and_refs
    engine = engine_for(hf, num_gpu_blocks=128, block_size=4, max_num_seqs=5)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        # Add one new request every third step, while others are mid-generation.
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [results[str(i)] for i in range(len(prompts))] == refs
