"""Prefix caching, preemption by swap/recompute, and chunked prefill keep outputs exact (issue 5)."""

from __future__ import annotations

import random

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.llm import LLM
from tests.engine.tiny_models import engine_for, hf_greedy_ids, make_hf_model

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
BACKENDS = ["reference", "sdpa", "triton"]


@pytest.fixture(scope="module")
def setup():
    hf = make_hf_model("gqa_tied")
    rng = random.Random(1)
    system = [rng.randrange(hf.config.vocab_size) for _ in range(37)]  # a shared "system prompt"
    prompts = [system + [rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (1, 3, 11, 16, 27, 5)]
    refs = [hf_greedy_ids(hf, p, MAX_NEW) for p in prompts]
    return hf, prompts, refs


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_on_and_off_match_transformers(setup, backend, prefix_caching):
    hf, prompts, refs = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4, attention_backend=backend,
                                     enable_prefix_caching=prefix_caching))
    first = _ids(llm.generate(prompts[:1], GREEDY))  # warms the cache with the system prompt
    second = _ids(llm.generate(prompts, GREEDY))  # the rest hit it
    assert first == refs[:1] and second == refs
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert (hits > 0) == prefix_caching


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_by_swap_and_recompute_matches_transformers(setup, backend, mode):
    hf, prompts, refs = setup
    # 20 blocks of 4 tokens: far less than the six requests need together.
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=20, block_size=4, attention_backend=backend,
                                     preemption_mode=mode, enable_prefix_caching=False))
    assert _ids(llm.generate(prompts, GREEDY)) == refs
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0
        assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
    if mode == "recompute":
        assert stats["num_swapped_out_blocks"] == 0
    assert stats["free_gpu_blocks"] == stats["total_gpu_blocks"]
    assert stats["free_cpu_blocks"] == stats["total_cpu_blocks"]


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full(setup):
    hf, prompts, refs = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=20, block_size=4, preemption_mode="swap",
                                     swap_space_gb=0.0, enable_prefix_caching=False))
    assert _ids(llm.generate(prompts, GREEDY)) == refs
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swapped_out_blocks"] == 0


@pytest.mark.parametrize("budget", list(range(1, 10)) + [16, 33, 64])
def test_every_chunk_size_matches_transformers(setup, budget):
    hf, prompts, refs = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=128, block_size=4, max_num_batched_tokens=budget))
    assert _ids(llm.generate(prompts, GREEDY)) == refs


@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_with_triton_backend(setup, budget):
    hf, prompts, refs = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=128, block_size=16, max_num_batched_tokens=budget,
                                     attention_backend="triton"))
    assert _ids(llm.generate(prompts[:3], GREEDY)) == refs[:3]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_penalties_and_seeded_sampling_survive_preemption(setup, mode):
    hf, prompts, _ = setup
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    roomy = LLM.from_engine(engine_for(hf, num_gpu_blocks=256, block_size=4))
    tight = LLM.from_engine(engine_for(hf, num_gpu_blocks=20, block_size=4, preemption_mode=mode))
    want = _ids(roomy.generate(prompts, params))
    got = _ids(tight.generate(prompts, params))
    assert tight.stats()["num_preemptions"] > 0
    assert got == want


def test_same_tenant_hits_the_cache_and_another_tenant_does_not(setup):
    hf, prompts, refs = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4))
    llm.generate([prompts[0]], GREEDY, tenant_id="acme")
    before = llm.stats()["prefix_cache_hit_tokens"]
    assert _ids(llm.generate([prompts[1]], GREEDY, tenant_id="globex")) == [refs[1]]
    assert llm.stats()["prefix_cache_hit_tokens"] == before, "another tenant must not share KV"
    assert _ids(llm.generate([prompts[1]], GREEDY, tenant_id="acme")) == [refs[1]]
    assert llm.stats()["prefix_cache_hit_tokens"] >= before + 36  # the 37-token system prompt's full blocks


def test_shared_namespace_option_shares_across_tenants(setup):
    hf, prompts, _ = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4, shared_prefix_cache=True))
    llm.generate([prompts[0]], GREEDY, tenant_id="acme")
    llm.generate([prompts[1]], GREEDY, tenant_id="globex")
    assert llm.stats()["prefix_cache_hit_tokens"] >= 36


def test_multi_turn_chat_reuses_the_previous_turn_including_generated_tokens(setup):
    hf, prompts, _ = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4))
    history = list(prompts[2])
    for turn in range(3):
        out = llm.generate([history], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        before = llm.stats()["prefix_cache_hit_tokens"]
        history = history + out.outputs[0].token_ids + [5, 6, 7]  # the "user" answers
        # The next turn's prompt = previous prompt + generated tokens + new text:
        # every full block of the previous turn (generated tokens included) is a hit.
        computed = len(history) - 3 - 1  # the last generated token's K/V was never computed
        llm.generate([history], SamplingParams(temperature=0, max_tokens=1))
        assert llm.stats()["prefix_cache_hit_tokens"] - before >= (computed // 4) * 4


def test_request_that_cannot_fit_alone_is_refused_at_once(setup):
    hf, _, _ = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=8, block_size=4))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=10))


def test_small_request_is_not_held_back_by_a_large_one(setup):
    hf, prompts, _ = setup
    engine = engine_for(hf, num_gpu_blocks=24, block_size=4, enable_prefix_caching=False)
    # A running request holds most of the pool.
    engine.add_request("big-running", [3] * 60, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    # A large request that fits alone but not now, then a small one behind it.
    engine.add_request("large", [4] * 70, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("small", [5] * 3, SamplingParams(max_tokens=2, ignore_eos=True))
    finished = []
    for _ in range(6):
        finished += [o.request_id for o in engine.step() if o.finished]
    assert "small" in finished, "the small request waited behind the large one"
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert set(finished) == {"small", "big-running", "large"}


def test_outputs_report_cached_tokens_and_queue_time(setup):
    hf, prompts, _ = setup
    llm = LLM.from_engine(engine_for(hf, num_gpu_blocks=64, block_size=4))
    first = llm.generate([prompts[0]], GREEDY)[0]
    second = llm.generate([prompts[1]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 36  # the system prompt's nine full blocks
    for out in (first, second):
        m = out.metrics
        assert m.queue_time is not None and 0 <= m.queue_time <= m.ttft
