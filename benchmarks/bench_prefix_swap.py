"""Prefix caching, preemption modes and chunked prefill, each against its baseline in one run.

Three workloads on the real SmolLM2-135M-Instruct (float32, this CPU; sizes scaled
down from the issue's GPU ones, see --help):
1. shared prefix: N requests sharing a long system prompt with distinct short
   questions, all submitted at once; TTFT p50 and output tokens/s, cache on vs off.
2. memory pressure: twice as many long requests as the KV pool holds at once;
   throughput with preemption by swap, recompute and auto; swap bandwidth
   (bytes moved / copy time) against a plain copy of the same size.
3. chunked prefill: decodes running while long prompts arrive; inter-token
   latency p99 of the decodes, chunked prefill on (small budget) vs off.

Usage: python benchmarks/bench_prefix_swap.py [--out benchmarks/results/prefix_swap_cpu.json]
On the GPU with dummy weights: ``--dummy llama-3-8b --device cuda --dtype bfloat16`` and the
issue's sizes (``--prefix-requests 200 --prefix-len 2000 --question-len 50 ...``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from engine import SamplingParams
from engine.llm import LLM, engine_from_loaded
from engine.llm_engine import EngineConfig, LLMEngine

VOCAB = [40000]  # token ids are drawn below this
BASE: dict = {}  # engine options common to every run (device, dtype, swap space)


def make_engine(loaded, **kw):
    """An engine over a loaded model, or over dummy weights when ``loaded`` is a dummy name."""
    kw = {**BASE, **kw}
    if isinstance(loaded, str):
        from engine.dummy_models import dummy_config

        return LLMEngine(dummy_config(loaded), None, None, EngineConfig(**kw), model_name=loaded)
    return engine_from_loaded(loaded, **kw)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_offline(loaded, prompts, params, **kw):
    llm = LLM.from_engine(make_engine(loaded, **kw))
    llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # warm-up (and warms nothing useful for others)
    llm.engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    ttft = [o.metrics.ttft for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return llm, {"wall_s": wall, "ttft_p50_s": float(np.median(ttft)), "output_tok_per_s": n_out / wall}


def shared_prefix(loaded, n, prefix_len, question_len, rng):
    system = rng.integers(100, VOCAB[0], prefix_len).tolist()
    prompts = [system + rng.integers(100, VOCAB[0], question_len).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    res = {}
    for on in (False, True):
        blocks = n * -(-(prefix_len + question_len + 16) // 16) + 64  # room for all: no preemption
        llm, r = run_offline(loaded, prompts, params, num_gpu_blocks=blocks, enable_prefix_caching=on,
                             max_num_batched_tokens=max(2048, prefix_len + question_len), max_num_seqs=n,
                             swap_space_gb=0.1)
        s = llm.stats()
        r["hit_rate"] = s["prefix_cache_hit_tokens"] / max(1, s["prefix_cache_queried_tokens"])
        res["cache_on" if on else "cache_off"] = r
        del llm
        _free()
    res["ttft_speedup"] = res["cache_off"]["ttft_p50_s"] / res["cache_on"]["ttft_p50_s"]
    return res


def memory_pressure(loaded, n, prompt_len, out_len, rng):
    prompts = [rng.integers(100, VOCAB[0], prompt_len).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    per_req_blocks = -(-(prompt_len + out_len) // 16)
    blocks = per_req_blocks * n // 2  # half the concurrent KV: preemption must happen
    res = {}
    # The first pass warms kernel compilation and graph capture for this shape; not recorded.
    for mode in ("warm-up", "recompute", "swap", "auto"):
        llm, r = run_offline(loaded, prompts, params, num_gpu_blocks=blocks,
                             preemption_mode="recompute" if mode == "warm-up" else mode,
                             enable_prefix_caching=False, max_num_seqs=n)
        if mode == "warm-up":
            del llm
            _free()
            continue
        s = llm.stats()
        r.update(preemptions=s["num_preemptions"], swapped_out_blocks=s["num_swapped_out_blocks"])
        res[mode] = r
        del llm
        _free()
    # Swap bandwidth: a batched swap-out of 64 blocks (all layers, K and V), against a plain
    # copy of the same bytes from the device to (pinned, on a GPU) host memory.
    eng = make_engine(loaded, num_gpu_blocks=128)
    mapping = [(i, i) for i in range(64)]
    eng.runner.swap(mapping, [])
    _sync()
    t0 = time.perf_counter()
    for _ in range(5):
        eng.runner.swap(mapping, [])
    _sync()
    swap_s = (time.perf_counter() - t0) / 5
    nbytes = 64 * eng.cost_model.bytes_per_block
    on_gpu = eng.device.type == "cuda"
    src = torch.empty(nbytes // 4, device=eng.device)
    dst = torch.empty(nbytes // 4, pin_memory=on_gpu)
    dst.copy_(src)
    _sync()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=on_gpu)
    _sync()
    copy_s = (time.perf_counter() - t0) / 5
    res["swap_bandwidth_GBps"] = nbytes / swap_s / 1e9
    res["plain_copy_GBps"] = nbytes / copy_s / 1e9
    res["swap_fraction_of_copy"] = copy_s / swap_s
    del eng
    _free()
    return res


def chunked_prefill(loaded, n_decodes, long_len, n_long, rng):
    res = {}
    for chunked in (False, True):
        budget = 256 if chunked else long_len + 64
        _free()
        eng = make_engine(loaded, num_gpu_blocks=2048, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked, enable_prefix_caching=False, swap_space_gb=0.1)
        dec = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i in range(n_decodes):
            eng.add_request(f"d{i}", rng.integers(100, VOCAB[0], 16).tolist(), dec)
        last: dict[str, float] = {}
        gaps: list[float] = []
        step = 0
        while eng.has_unfinished_requests():
            if step in (5, 15, 25) and step // 10 < n_long:
                eng.add_request(f"long{step}", rng.integers(100, VOCAB[0], long_len).tolist(), SamplingParams(max_tokens=1))
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id.startswith("d"):
                    if o.request_id in last:
                        gaps.append(now - last[o.request_id])
                    last[o.request_id] = now
            step += 1
        res["chunked_on" if chunked else "chunked_off"] = {
            "itl_p50_ms": float(np.percentile(gaps, 50) * 1000), "itl_p99_ms": float(np.percentile(gaps, 99) * 1000),
            "itl_max_ms": float(max(gaps) * 1000), "budget": budget,
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/prefix_swap_cpu.json")
    ap.add_argument("--prefix-requests", type=int, default=40)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--pressure", default="16,256,64", help="requests,prompt,output")
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--dummy", default=None, help="dummy-weight shape (engine.dummy_models) instead of SmolLM2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--swap-space-gb", type=float, default=1.0)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (faster start-up)")
    ap.add_argument("--only", default="shared_prefix,memory_pressure,chunked_prefill", help="workloads to run")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    BASE.update(device=args.device, dtype=args.dtype, swap_space_gb=args.swap_space_gb)
    if args.no_compile:
        BASE["compile_model"] = False
    if args.dummy:
        from engine.dummy_models import dummy_config

        loaded, VOCAB[0] = args.dummy, dummy_config(args.dummy).vocab_size
    else:
        from engine.loader import load_model

        loaded = load_model("smollm2-135m-instruct")
    n_p, p_len, o_len = (int(x) for x in args.pressure.split(","))
    workloads = {
        "shared_prefix": lambda: shared_prefix(loaded, args.prefix_requests, args.prefix_len, args.question_len, rng),
        "memory_pressure": lambda: memory_pressure(loaded, n_p, p_len, o_len, rng),
        "chunked_prefill": lambda: chunked_prefill(loaded, 8, args.long_len, 3, rng),
    }
    result = {"date": time.strftime("%Y-%m-%d"), "model": f"{args.dummy or 'smollm2-135m-instruct'} {args.dtype} {args.device}"}
    for name in args.only.split(","):
        result[name] = workloads[name]()
    Path(args.out).write_text(json.dumps(result, indent=2))
    report(result, args)


def report(result: dict, args) -> None:
    if "shared_prefix" in result:
        sp = result["shared_prefix"]
        print(f"shared prefix ({args.prefix_requests} x {args.prefix_len}+{args.question_len}): TTFT p50 off {sp['cache_off']['ttft_p50_s']*1000:.0f} ms, "
          f"on {sp['cache_on']['ttft_p50_s']*1000:.0f} ms ({sp['ttft_speedup']:.1f}x); out tok/s off "
          f"{sp['cache_off']['output_tok_per_s']:.1f}, on {sp['cache_on']['output_tok_per_s']:.1f}; hit rate {sp['cache_on']['hit_rate']:.2f}")
    if "memory_pressure" in result:
        mp = result["memory_pressure"]
        for mode in ("recompute", "swap", "auto"):
            r = mp[mode]
            print(f"memory pressure {mode:<9}: {r['output_tok_per_s']:.1f} out tok/s, {r['preemptions']} preemptions, {r['swapped_out_blocks']} blocks swapped out")
        print(f"swap copy {mp['swap_bandwidth_GBps']:.2f} GB/s vs plain copy {mp['plain_copy_GBps']:.2f} GB/s ({mp['swap_fraction_of_copy']:.0%})")
    for k in ("chunked_off", "chunked_on") if "chunked_prefill" in result else ():
        r = result["chunked_prefill"][k]
        print(f"{k:<12} (budget {r['budget']}): ITL p50 {r['itl_p50_ms']:.0f} ms, p99 {r['itl_p99_ms']:.0f} ms, max {r['itl_max_ms']:.0f} ms")


if __name__ == "__main__":
    main()
