"""Tensor parallelism on the CPU: real worker processes over gloo.

tensor_parallel_size=2 must give the same greedy tokens as tensor_parallel_size=1
(the sharded layers, the vocabulary-parallel embedding and head, and each rank's
share of the paged KV cache), and a worker that dies must fail the engine with
an error rather than hang it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
import torch

from engine import SamplingParams
from engine.async_llm import AsyncLLM
from engine.distributed import TensorParallelGroup, get_tp_group
from engine.errors import EngineDeadError
from engine.llm import LLM, engine_from_loaded
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.llama import LlamaForCausalLM
from tests.engine.tiny_models import TINY_CONFIGS, make_hf_model, model_config_from_hf

PROMPTS = [[1, 5, 9, 13, 2], [7], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _greedy(engine: LLMEngine, prompts, params=GREEDY, late_every: int = 0) -> list[list[int]]:
    """Every prompt's output ids; with ``late_every``, one request joins every that many steps."""
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (not late_every or step % late_every == 0):
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
            if late_every:
                break
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


def _engine(hf, tp: int, **kw) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_gpu_blocks", 64)
    return LLMEngine(model_config_from_hf(hf), hf.state_dict(), None, EngineConfig(tensor_parallel_size=tp, **kw))


def _workers_gone(procs) -> bool:
    return all(not p.is_alive() for p in procs)


def test_sharded_model_loads_each_ranks_slice():
    """Without processes: rank r's tensors are the r-th slices of the full checkpoint."""
    hf = make_hf_model("mha_untied")
    cfg = model_config_from_hf(hf)
    sd = hf.state_dict()
    shards = []
    for rank in range(2):
        m = LlamaForCausalLM(cfg, TensorParallelGroup(rank, 2))
        m.load_hf_state_dict(sd)
        shards.append(m)
    attn = [m.model.layers[1].self_attn for m in shards]
    q = sd["model.layers.1.self_attn.q_proj.weight"]
    k = sd["model.layers.1.self_attn.k_proj.weight"]
    half_q, half_k = q.shape[0] // 2, k.shape[0] // 2
    for rank, a in enumerate(attn):
        assert a.num_heads == 2 and a.num_kv_heads == 2
        w = a.qkv_proj.weight
        assert torch.equal(w[:half_q], q[rank * half_q:(rank + 1) * half_q])
        assert torch.equal(w[half_q:half_q + half_k], k[rank * half_k:(rank + 1) * half_k])
    o = sd["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), o)
    emb = sd["model.embed_tokens.weight"]  # vocab 101 -> 51 rows a rank, one padding row
    e = [m.model.embed_tokens.weight for m in shards]
    assert e[0].shape[0] == 51 and torch.equal(torch.cat(e)[:101], emb) and not e[1][-1].any()
    assert get_tp_group().world_size == 1  # building shards never joins a group


def test_load_reports_missing_and_misshaped_tensors():
    hf = make_hf_model("gqa_tied")
    cfg = model_config_from_hf(hf)
    sd = hf.state_dict()
    del sd["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.2.mlp.up_proj.weight'\]"):
        LlamaForCausalLM(cfg).load_hf_state_dict(sd)
    sd = hf.state_dict()
    sd["model.layers.0.self_attn.v_proj.weight"] = sd["model.layers.0.self_attn.v_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="v_proj.weight has shape"):
        LlamaForCausalLM(cfg).load_hf_state_dict(sd)


@pytest.mark.parametrize("name", ["mha_untied", "gqa_tied"])
def test_tp2_greedy_equals_tp1_on_tiny_models(name):
    hf = make_hf_model(name)
    expected = _greedy(_engine(hf, 1), PROMPTS)
    engine = _engine(hf, 2)
    procs = list(engine.executor.procs)
    try:
        assert engine.executor.world_size == 2 and len(procs) == 1 and procs[0].is_alive()
        # Each rank holds half the KV heads in a cache of the same geometry.
        assert engine.runner.kv_caches[0][0].shape[2] == TINY_CONFIGS[name]["num_key_value_heads"] // 2
        assert _greedy(engine, PROMPTS) == expected
        # Requests joining mid-generation, chunked prefill across steps, and a
        # second round on the same workers.
        assert _greedy(engine, PROMPTS, late_every=3) == expected
        stats = engine.stats()
        assert stats["free_gpu_blocks"] == stats["total_gpu_blocks"]
    finally:
        engine.shutdown()
    assert _workers_gone(procs) and procs[0].exitcode == 0  # asked to stop, not killed
    assert get_tp_group().world_size == 1 and not torch.distributed.is_initialized()


def test_tp2_matches_tp1_with_swapping_preemption_and_chunked_prefill():
    hf = make_hf_model("gqa_tied")
    prompts = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(6)]
    kw = dict(num_gpu_blocks=14, block_size=4, max_num_batched_tokens=8, preemption_mode="swap")
    expected = _greedy(_engine(hf, 1, **kw), prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine = _engine(hf, 2, **kw)
    try:
        got = _greedy(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert engine.stats()["num_swapped_out_blocks"] > 0, "the pool was meant to force swapping"
        assert got == expected
    finally:
        engine.shutdown()


def test_tp2_greedy_equals_tp1_on_stories260k(stories_model):
    prompts = [stories_model.tokenizer.encode(t) for t in
               ("Once upon a time", "Lily", "The dog ran to the park and saw a big red ball. He", "Sue had a cat.")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM.from_engine(engine_from_loaded(stories_model)).generate(prompts, params)]
    engine = engine_from_loaded(stories_model, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    finally:
        engine.shutdown()
    assert got == expected


def test_sizes_that_do_not_fit_are_refused_before_any_process_starts():
    hf = make_hf_model("gqa_odd_headdim")  # 5 query heads, 1 KV head
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads"):
        _engine(hf, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    if not torch.cuda.is_available():  # on a GPU host the count differs; the CPU case is exact
        with pytest.raises(ValueError, match="GPUs"):
            _engine(make_hf_model("mha_untied"), 2, device="cuda")
    assert not torch.distributed.is_initialized()


def test_a_worker_killed_between_steps_fails_the_next_step_cleanly():
    hf = make_hf_model("mha_untied")
    engine = _engine(hf, 2)
    try:
        engine.add_request("a", PROMPTS[0], GREEDY)
        engine.step()
        os.kill(engine.executor.procs[0].pid, signal.SIGKILL)
        engine.executor.procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 .* exited with code -9"):
            engine.step()
        assert time.monotonic() - t0 < 30
        with pytest.raises(EngineDeadError):  # and stays dead
            engine.step()
    finally:
        engine.shutdown()
    assert not torch.distributed.is_initialized()


def test_a_worker_killed_mid_generation_ends_async_requests_with_an_error():
    """The worker dies while steps run; every waiting stream gets EngineDeadError, none hangs."""
    hf = make_hf_model("mha_untied")
    engine = _engine(hf, 2, num_gpu_blocks=512)  # room for all three (101 blocks each): no preemption
    procs = list(engine.executor.procs)
    llm = AsyncLLM(engine=engine)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    started: dict[str, asyncio.Event] = {}

    async def consume(rid):
        n = 0
        async for out in llm.generate([1, 2, 3], long, request_id=rid):
            n += len(out.outputs[0].delta_token_ids)
            started[rid].set()
        return n

    async def main():
        for i in range(3):
            started[f"s{i}"] = asyncio.Event()
        tasks = [asyncio.create_task(consume(f"s{i}")) for i in range(3)]
        # Every stream is decoding before the kill (bounded wait: a stuck test must fail, not hang).
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), timeout=60)
        os.kill(engine.executor.procs[0].pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "rank 1" in str(results[0])
        assert not llm.is_alive and "rank 1" in llm.dead_reason  # what /health reports

        async def after():
            async for _ in llm.generate([1, 2], GREEDY, request_id="late"):
                pass

        with pytest.raises(EngineDeadError, match="rank 1"):  # new requests are refused, with the reason
            asyncio.run(after())
    finally:
        llm.shutdown()
    assert _workers_gone(procs) and not torch.distributed.is_initialized()


def test_a_worker_that_cannot_load_reports_its_error():
    """A worker whose shard fails to build: the engine's constructor raises with the worker's reason."""
    hf = make_hf_model("mha_untied")
    cfg = model_config_from_hf(hf)
    sd = hf.state_dict()
    # Rank 0 checks options before workers start, so give the worker a spec only it
    # reads: an attention backend that does not exist.
    from engine.executor import TensorParallelExecutor, WorkerSpec

    spec = WorkerSpec(cfg, sd, torch.float32, "cpu", 8, 4, 0, "no-such-backend", 8, 64, False, 0, 30.0)
    ex = TensorParallelExecutor(spec, 2)
    try:
        with pytest.raises(EngineDeadError, match="rank 1 failed to start(.|\n)*no-such-backend"):
            ex.wait_ready(runner=None, timeout_s=60)
    finally:
        ex.shutdown()
    assert not ex.procs and not torch.distributed.is_initialized()


def test_a_worker_dying_while_idle_is_seen_without_a_request():
    hf = make_hf_model("mha_untied")
    llm = AsyncLLM(engine=_engine(hf, 2))
    try:
        assert llm.is_alive and llm.dead_reason is None
        os.kill(llm.engine.executor.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.is_alive and "rank 1" in llm.dead_reason
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def test_one_tensor_parallel_engine_per_process_and_a_dropped_one_frees_its_place():
    hf = make_hf_model("mha_untied")
    first = _engine(hf, 2)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="already runs a tensor-parallel engine"):
            _engine(hf, 2)
        assert time.monotonic() - t0 < 5  # refused before any process starts
        assert _greedy(first, PROMPTS[:2]) == _greedy(_engine(hf, 1), PROMPTS[:2])  # the first one is untouched
    finally:
        first.shutdown()
    dropped = _engine(hf, 2)
    procs = list(dropped.executor.procs)
    del dropped  # never shut down: its finalizer stops the workers and leaves the group
    gc.collect()
    assert _workers_gone(procs) and not torch.distributed.is_initialized()
    again = _engine(hf, 2)
    try:
        assert _greedy(again, PROMPTS[:1]) == _greedy(_engine(hf, 1), PROMPTS[:1])
    finally:
        again.shutdown()
