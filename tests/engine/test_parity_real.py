"""Greedy parity with transformers (float32, CPU) on real weights: stories260K and SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm import LLM, encode_chat, engine_from_loaded
from tests.hf_reference import hf_greedy

STORY_PROMPTS = [
    "Once upon a time",
    "Lily",
    "The dog ran to the park and saw a big red ball. He",
    "One day, a little bird",
    "Tom and his mom went to the store to buy some apples. Tom wanted to eat them all, but mom said",
    "The sun",
    "There was a boy who loved to play with his toy car every day after school. One morning",
    "Sue had a cat.",
]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a short tip for writing clean Python code that other people can read easily.",
]


def _check_parity(loaded, prompts_ids, max_new, **engine_kwargs):
    refs = hf_greedy(loaded.hf_dir, prompts_ids, max_new)
    llm = LLM.from_engine(engine_from_loaded(loaded, **engine_kwargs))
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts_ids, params)]
    assert len({len(p) for p in prompts_ids}) >= 6, "prompts of different lengths"
    mismatches = [i for i, (a, b) in enumerate(zip(batched, refs)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ from transformers"

    # Requests arriving while others are mid-generation.
    engine = llm.engine
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts_ids))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 4 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"late-{i}", p, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[f"late-{i}"] for i in range(len(prompts_ids))] == refs
    stats = llm.stats()
    assert stats["free_gpu_blocks"] == stats["total_gpu_blocks"]


def test_stories260k_greedy_matches_transformers(stories_model):
    tok = stories_model.tokenizer
    prompts = [tok.encode(p) for p in STORY_PROMPTS]
    _check_parity(stories_model, prompts, 40, num_gpu_blocks=256, block_size=16)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_model):
    llm_for_template = engine_from_loaded(smollm2_model, num_gpu_blocks=64)
    prompts = [encode_chat(llm_for_template, [{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    del llm_for_template
    _check_parity(smollm2_model, prompts, 24, num_gpu_blocks=512, block_size=16)


@pytest.mark.slow
def test_smollm2_preemption_keeps_parity(smollm2_model):
    tok = smollm2_model.tokenizer
    prompts = [tok.encode(q) for q in CHAT_QUESTIONS]
    refs = hf_greedy(smollm2_model.hf_dir, prompts, 16)
    # 12 blocks of 8 tokens cannot hold all eight requests at once: preemption must happen.
    llm = LLM.from_engine(engine_from_loaded(smollm2_model, num_gpu_blocks=12, block_size=8))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.stats()["num_preemptions"] > 0
