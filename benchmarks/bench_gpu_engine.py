"""The engine on the GPU: parity first, then throughput and single-stream decode.

Run on the device machine (one call):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_gpu_engine.py --out $OUT

1. Ceiling: device-to-device copy bandwidth (bytes read + written), this run.
2. Parity: greedy token ids of the engine (fp32, Triton attention, CUDA graphs,
   and eager) against transformers (fp32) on stories260K (``.models/stories260k``,
   a Hugging Face folder converted from the GGUF) and tiny random Llama/Qwen2
   models; bf16 logits against the fp32 ones (largest difference).
3. Baseline: transformers ``generate``, static left-padded batch, on the first
   ``--baseline-requests`` of the workload; then the engine on all of it
   (Llama-3-8B shape, dummy bf16 weights, lognormal ShareGPT-like lengths, EOS
   ignored); output tokens/s of each.
4. CUDA-graph replay time per batch bucket, and single-stream decode (batch 1)
   against the weight-bytes roofline; a profile of one eager batch-1 step.
5. The same with ``torch.compile`` on the decoder layers (kept only if faster).
A short table is printed last; JSON goes to ``--out/bench_gpu_engine.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from engine.attention import AttentionMetadata  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.dummy_models import dummy_config, weight_bytes  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

RESULTS: dict = {}
OUT_PATH = ""


def save() -> None:
    with open(OUT_PATH, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a 1 GiB device copy (median of 20)."""
    n = ((1 << 30) if torch.device(device).type == "cuda" else (1 << 26)) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / float(np.median(times[5:]))


# -- parity -------------------------------------------------------------------------
def config_from_hf(c) -> ModelConfig:
    rope = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    return ModelConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None),
        rms_norm_eps=c.rms_norm_eps, rope_theta=rope, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.model_type == "qwen2",
    )


def tiny_hf_models(device):
    """(name, HF model fp32 on device) for random tiny Llama and Qwen2 (qkv bias) models."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    specs = [
        ("llama_gqa_hd64", LlamaConfig, LlamaForCausalLM, dict(hidden_size=256, intermediate_size=512,
         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=1000,
         tie_word_embeddings=False, rope_theta=500000.0)),
        ("llama_gqa4_hd128_tied", LlamaConfig, LlamaForCausalLM, dict(hidden_size=512, intermediate_size=768,
         num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2, vocab_size=777,
         tie_word_embeddings=True)),
        ("qwen2_bias_gqa7", Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=448, intermediate_size=640,
         num_attention_heads=7, num_key_value_heads=1, num_hidden_layers=2, vocab_size=911,
         tie_word_embeddings=True, use_sliding_window=False)),
    ]
    for name, cfg_cls, model_cls, kw in specs:
        torch.manual_seed(0)
        cfg = cfg_cls(max_position_embeddings=1024, rms_norm_eps=1e-6, **kw)
        hf = model_cls(cfg).eval()
        with torch.no_grad():
            for n_, p in hf.named_parameters():
                if p.dim() == 2:
                    p.mul_(4.0)  # sharpen random init so greedy choices are decisive
                elif n_.endswith(".bias"):
                    p.uniform_(-0.5, 0.5)
        yield name, hf.to(device)


def stories_hf(device, folder):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf.to(device)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int, device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = LLM.from_engine(engine).generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """``(n, vocab)`` fp32 logits of one prompt through the runner (blocks 0.. of an idle engine)."""
    r = engine.runner
    dev, n = r.device, len(ids)
    nb = -(-n // r.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None], max_query_len=n, max_seq_len=n,
        decode_only=n == 1,
    )
    x = torch.tensor(ids, device=dev)
    hidden = r.model(x, torch.arange(n, device=dev), r.kv_caches, meta, r.backend)
    return r.model.compute_logits(hidden)


def parity_one(name, hf, device, rng, n_new=24, n_prompts=8) -> dict:
    cfg = config_from_hf(hf.config)
    sd = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    lens = [1, 2, 15, 16, 17, 33, 64, 100][:n_prompts]
    prompts = [rng.integers(3, cfg.vocab_size, size=L).tolist() for L in lens]
    ref = [hf_greedy(hf, p, n_new, device) for p in prompts]
    res = {"model": name, "prompt_lens": lens, "new_tokens": n_new}
    common = dict(device=str(device), num_gpu_blocks=256, block_size=16, max_num_seqs=8, seed=0,
                  enable_prefix_caching=False, swap_space_gb=0.01)
    backend = "triton"
    for label, graphs in (("graphs", True), ("eager", False)):
        eng = LLMEngine(cfg, sd, None, EngineConfig(dtype="float32", attention_backend=backend, cuda_graphs=graphs,
                                                   **common))
        got = engine_greedy(eng, prompts, n_new)
        res[f"fp32_{label}_match"] = sum(a == b for a, b in zip(got, ref))
        res[f"fp32_{label}_first_diff"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                          for a, b in zip(got, ref)]
        if label == "graphs":
            l32 = prefill_logits(eng, prompts[-1])
            with torch.no_grad():
                href = hf(torch.tensor([prompts[-1]], device=device)).logits[0].float()
            res["fp32_vs_hf_max_logit_diff"] = float((l32 - href).abs().max())
        del eng
    eng16 = LLMEngine(cfg, sd, None, EngineConfig(dtype="bfloat16", attention_backend=backend, **common))
    l16 = prefill_logits(eng16, prompts[-1])
    res["bf16_max_logit_diff"] = float((l16 - l32).abs().max())
    res["bf16_max_abs_logit"] = float(l32.abs().max())
    res["bf16_rel_diff"] = float((l16 - l32).norm() / l32.norm())
    res["bf16_top1_agree"] = float((l16.argmax(-1) == l32.argmax(-1)).float().mean())
    got16 = engine_greedy(eng16, prompts, n_new)
    res["bf16_greedy_match_of_fp32"] = sum(a == b for a, b in zip(got16, ref))
    res["n_prompts"] = len(prompts)
    res["pass"] = res["fp32_graphs_match"] == len(prompts) and res["fp32_eager_match"] == len(prompts)
    return res


def run_parity(device, stories_dir) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    models = []
    if stories_dir and os.path.isdir(stories_dir):
        models.append(("stories260k", lambda: stories_hf(device, stories_dir)))
    else:
        out.append({"model": "stories260k", "skipped": f"no folder {stories_dir}"})
    for name, hf in tiny_hf_models(device):
        models.append((name, (lambda h=hf: h)))
    for name, make in models:
        try:
            r = parity_one(name, make(), device, rng)
        except Exception as exc:  # record and go on: the timing still matters
            r = {"model": name, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        print("parity", json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
        out.append(r)
    return out


# -- throughput -------------------------------------------------------------------
def workload(n: int, vocab: int, seed: int = 0, cap_out: int = 1024):
    """ShareGPT-like lengths: lognormal with means ~161 in / ~338 out (vLLM paper), clipped."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    ins = np.clip(rng.lognormal(math.log(161) - sigma**2 / 2, sigma, n), 8, 1024).astype(int)
    outs = np.clip(rng.lognormal(math.log(338) - sigma**2 / 2, sigma, n), 16, cap_out).astype(int)
    prompts = [rng.integers(1000, vocab - 1000, size=int(L)).tolist() for L in ins]
    return prompts, outs.tolist()


@torch.inference_mode()
def hf_baseline(cfg: ModelConfig, prompts, outs, device, batch: int) -> dict:
    """transformers generate, one static batch (left padding) per ``batch`` requests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hcfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, rope_theta=cfg.rope_theta,
                       max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                       tie_word_embeddings=cfg.tie_word_embeddings)
    hcfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device(device):
        hf = LlamaForCausalLM(hcfg).eval()
    torch.set_default_dtype(prev)
    build_s = time.perf_counter() - t0

    def gen(ps, n):
        width = max(len(p) for p in ps)
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        return out.shape[1] - width

    gen(prompts[:2], 4)  # warm-up
    sync(device)
    useful = generated = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        ps, ns = prompts[s:s + batch], outs[s:s + batch]
        generated += gen(ps, max(ns)) * len(ps)
        useful += sum(ns)
    sync(device)
    secs = time.perf_counter() - t0
    del hf
    return {"requests": len(prompts), "batch": batch, "seconds": secs, "output_tokens": useful,
            "generated_incl_padding": generated, "output_tok_s": useful / secs, "build_s": build_s}


class StepTimer:
    """Host time per step phase: schedule, execute (launches), sample (waits for the GPU)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.t = {"schedule": 0.0, "execute": 0.0, "sample": 0.0, "step": 0.0}
        self.per_step: dict[str, list[float]] = {k: [] for k in self.t}
        self.steps = self.graph_steps = 0
        self.engine = engine
        sch, run, smp, stp = engine.scheduler.schedule, engine.runner.execute, engine.sampler, engine.step
        gstep = engine.runner._graph_step

        def timed(key, fn):
            def w(*a, **k):
                t0 = time.perf_counter()
                r = fn(*a, **k)
                self.t[key] += time.perf_counter() - t0
                self.per_step[key].append(time.perf_counter() - t0)
                return r
            return w

        engine.scheduler.schedule = timed("schedule", sch)
        engine.runner.execute = timed("execute", run)
        self.sampler = smp
        engine.sampler = timed("sample", smp)
        engine.step = timed("step", stp)

        def g(*a, **k):
            self.graph_steps += 1
            return gstep(*a, **k)

        engine.runner._graph_step = g

    def summary(self) -> dict:
        return {k + "_s": v for k, v in self.t.items()} | {"graph_steps": self.graph_steps}


def run_throughput(engine: LLMEngine, prompts, outs) -> dict:
    llm = LLM.from_engine(engine)
    w = min(8, len(prompts))
    llm.generate(prompts[:w], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * w)  # warm-up
    timer = StepTimer(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    steps = 0
    orig_step = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return orig_step()

    engine.step = counting_step
    sync(engine.device)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    sync(engine.device)
    secs = time.perf_counter() - t0
    engine.step = orig_step
    n_out = sum(len(o.outputs[0].token_ids) for o in res)
    assert n_out == sum(outs), (n_out, sum(outs))
    return {"requests": len(prompts), "seconds": secs, "output_tokens": n_out,
            "input_tokens": sum(map(len, prompts)), "output_tok_s": n_out / secs,
            "total_tok_s": (n_out + sum(map(len, prompts))) / secs, "steps": steps,
            "preemptions": engine.scheduler.num_preemptions} | timer.summary()


@torch.inference_mode()
def replay_times(engine: LLMEngine, sizes) -> dict:
    """GPU ms per replay of each bucket (CUDA events, median of 20)."""
    g = engine.runner.graphs
    out = {}
    for bs in sizes:
        if bs not in g.graphs:
            continue
        for _ in range(3):
            g.replay(bs)
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay(bs)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        out[bs] = float(np.median(ts))
    return out


def single_stream(engine: LLMEngine, n_out: int = 257, prompt_len: int = 128) -> dict:
    """Batch-1 decode: ms between consecutive tokens (host clock, the whole engine step)."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(1000, engine.model_config.vocab_size - 1000, size=prompt_len).tolist()
    engine.add_request("single", prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    stamps = []
    timer = StepTimer(engine)
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    for key in ("scheduler", "runner"):
        vars(getattr(engine, key)).pop("schedule" if key == "scheduler" else "execute", None)
    vars(engine.runner).pop("_graph_step", None)
    vars(engine).pop("step", None)
    engine.sampler = timer.sampler
    gaps = np.diff(stamps[1:])  # decode steps only (the first step is the prefill)
    # Medians over decode steps (the first step is the prefill).
    host = {f"host_{k}_ms_median": 1e3 * float(np.median(v[1:])) for k, v in timer.per_step.items() if len(v) > 1}
    return host | {"tokens": n_out, "ms_per_token_median": 1e3 * float(np.median(gaps)),
            "ms_per_token_mean": 1e3 * float(np.mean(gaps)), "ms_per_token_p90": 1e3 * float(np.percentile(gaps, 90))}


def host_breakdown(engine: LLMEngine, iters: int = 50) -> dict:
    """Host microseconds of each piece of a batch-1 decode step, the GPU idle before each piece.

    Shows which host work sits on the critical path between two graph replays.
    """
    rng = np.random.default_rng(5)
    engine.add_request("hb", rng.integers(1000, 5000, size=128).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=2 * iters + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    runner, g = engine.runner, engine.runner.graphs
    parts: dict[str, list[float]] = {k: [] for k in ("schedule", "build_step_input", "graph_inputs", "replay_call",
                                                   "compute_logits_call", "sample", "whole_step")}
    for _ in range(iters):
        sync(engine.device)
        t0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        t1 = time.perf_counter()
        step = runner.build_step_input(plan.scheduled)
        t2 = time.perf_counter()
        with torch.inference_mode():
            bs = g.bucket(1)
            replay, calls = g.replay, []
            g.replay = lambda b: calls.append(b)  # the input half of _graph_step only
            try:
                runner._graph_step(step)
            finally:
                g.replay = replay
            t3 = time.perf_counter()
            hidden = g.replay(bs)
            t4 = time.perf_counter()
            logits = runner.model.compute_logits(hidden[:1])
            t5 = time.perf_counter()
        engine.scheduler.update_after_step(plan)
        sampled = engine.sampler(logits, [p.request for p in plan.scheduled])
        t6 = time.perf_counter()
        for p, tok_id, lp in zip(plan.scheduled, sampled.token_ids, sampled.logprobs):
            engine._advance(p.request, tok_id, lp, time.monotonic())
        sync(engine.device)
        t7 = time.perf_counter()
        sync(engine.device)
        t8 = time.perf_counter()
        engine.step()
        sync(engine.device)
        t9 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t9 - t8)):
            parts[k].append(1e6 * v)
    while engine.has_unfinished_requests():
        engine.step()
    out = {f"{k}_us_median": float(np.median(v)) for k, v in parts.items()}
    # Single host operations of the graph-input path, 200 calls each.
    tok, seq = runner._graph_host
    ev = torch.cuda.Event()
    ops = {
        "h2d_tokens": lambda: g.token_buf.copy_(tok, non_blocking=True),
        "h2d_seq_b1": lambda: g.seq_buf[: g.max_num_seqs + g.width].copy_(seq[: g.max_num_seqs + g.width],
                                                                          non_blocking=True),
        "event_record": ev.record,
        "event_sync": ev.synchronize,
        "replay_b1": lambda: g.replay(1),
        "lm_head_b1": lambda: runner.model.compute_logits(g.outputs[1][:1]),
        "argmax_tolist_b1": lambda: runner.model.compute_logits(g.outputs[1][:1]).argmax(-1).tolist(),
    }
    for name, fn in ops.items():
        ts = []
        for _ in range(200):
            sync(engine.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                fn()
            ts.append(1e6 * (time.perf_counter() - t0))
        out[f"op_{name}_us_median"] = float(np.median(ts))
    sync(engine.device)
    return out


@torch.inference_mode()
def profile_eager_step(engine: LLMEngine, top: int = 12) -> dict:
    """Kernel time of one eager batch-1 decode step, grouped, to show what the GPU does."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    engine.runner.graphs = None
    rng = np.random.default_rng(3)
    engine.add_request("prof", rng.integers(1000, 5000, size=64).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync(engine.device)
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.graphs = graphs
    rows = []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        dt = getattr(e, "self_device_time_total", None) or getattr(e, "device_time_total", 0)
        rows.append((e.key[:90], e.count, dt))
    rows.sort(key=lambda r: -r[2])
    gemm_keys = ("gemm", "gemv", "nvjet", "cutlass", "sm90", "matmul", "cublas")
    return {"gpu_us_total": sum(r[2] for r in rows), "kernels": sum(r[1] for r in rows),
            "gemm_us": sum(r[2] for r in rows if any(k in r[0].lower() for k in gemm_keys)),
            "triton_us": sum(r[2] for r in rows if "triton" in r[0].lower() or r[0].startswith("_")),
            "top": [{"kernel": k, "count": c, "us": t} for k, c, t in rows[:top]],
            "table": prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)[-6000:]}


@torch.inference_mode()
def gemm_batch1(cfg: ModelConfig, device, copies: int = 16) -> dict:
    """ms and read bandwidth of each batch-1 projection (bf16 ``F.linear``, cuBLAS), rotating
    ``copies`` weight copies so small ones are not served from L2; graph-replayed, per call.

    Both the separate shapes and the fused ones (q|k|v, gate|up) the model uses.
    """
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (f, h), "up": (f, h),
              "down": (h, f), "qkv_fused": (q + 2 * kv, h), "gate_up_fused": (2 * f, h),
              "lm_head": (cfg.vocab_size, h)}
    out = {}
    for name, (n, k) in shapes.items():
        reps = copies if n * k * 2 < (1 << 28) else 2
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(reps)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        for w in ws:
            torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for w in ws:
                torch.nn.functional.linear(x, w)
        g.replay()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / reps)
        ms = float(np.median(ts))
        out[name] = {"ms": ms, "read_TBps": n * k * 2 / ms / 1e9}
        del ws, g
    L = cfg.num_hidden_layers
    layer_now = sum(out[k]["ms"] for k in ("q", "k", "v", "o", "gate", "up", "down"))
    layer_fused = sum(out[k]["ms"] for k in ("qkv_fused", "o", "gate_up_fused", "down"))
    out["model_ms_separate"] = L * layer_now + out["lm_head"]["ms"]
    out["model_ms_fused"] = L * layer_fused + out["lm_head"]["ms"]
    return out


def free(*objs) -> None:
    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_section(label, cfg, device, args, prompts, outs, compile_model: bool, copy_bw: float) -> dict:
    t0 = time.perf_counter()
    ec = EngineConfig(dtype=args.dtype, device=str(device), block_size=16, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                      gpu_memory_utilization=args.gpu_mem, enable_prefix_caching=False, swap_space_gb=1.0,
                      cuda_graphs=device.type == "cuda", compile_model=compile_model and device.type == "cuda", seed=0,
                      num_gpu_blocks=args.num_gpu_blocks)
    engine = LLMEngine(cfg, None, None, ec, model_name=args.model)
    sync(device)
    r: dict = {"label": label, "init_s": time.perf_counter() - t0, "num_gpu_blocks": engine.block_manager.num_blocks}
    wb = weight_bytes(engine.runner.model)
    r["weight_bytes"] = wb
    r["roofline_ms"] = 1e3 * wb / copy_bw
    print(label, "engine up", json.dumps(r), flush=True)
    if engine.runner.graphs is not None:
        r["replay_ms"] = replay_times(engine, [1, 8, 32, 64, 128, 256, 512, 1024])
        print(label, "replay", r["replay_ms"], flush=True)
    r["single"] = single_stream(engine)
    r["single"]["fraction_of_roofline"] = r["roofline_ms"] / r["single"]["ms_per_token_median"]
    print(label, "single", r["single"], flush=True)
    if engine.runner.graphs is not None:
        try:
            r["host_breakdown_b1"] = host_breakdown(engine)
        except Exception as exc:
            r["host_breakdown_b1"] = {"error": repr(exc), "trace": traceback.format_exc()[-1500:]}
        print(label, "host breakdown", r["host_breakdown_b1"], flush=True)
    RESULTS[label] = r
    save()
    if args.profile:
        try:
            r["profile_eager_b1"] = profile_eager_step(engine)
            print(label, "profile", json.dumps(r["profile_eager_b1"])[:1500], flush=True)
        except Exception as exc:
            r["profile_eager_b1"] = {"error": repr(exc)}
    if prompts and "throughput" not in args.skip:
        r["throughput"] = run_throughput(engine, prompts, outs)
        print(label, "throughput", r["throughput"], flush=True)
    save()
    del engine
    free()
    return r


def main() -> None:
    global OUT_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--baseline-requests", type=int, default=128)
    ap.add_argument("--baseline-batch", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--cap-out", type=int, default=1024, help="longest output, tokens")
    ap.add_argument("--stories", default=".models/stories260k")
    ap.add_argument("--skip", default="", help="comma list of: parity,baseline,engine,compile")
    ap.add_argument("--compile-throughput", action="store_true", help="also run the workload compiled")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out, exist_ok=True)
    OUT_PATH = os.path.join(args.out, "bench_gpu_engine.json")
    device = torch.device(args.device)
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "args": vars(args)}
    try:
        import transformers
        import triton

        RESULTS["env"] |= {"transformers": transformers.__version__, "triton": triton.__version__}
    except Exception:
        pass
    bw = copy_bandwidth(device)
    RESULTS["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    save()

    if "parity" not in skip:
        RESULTS["parity"] = run_parity(device, args.stories)
        save()

    cfg = dummy_config(args.model)
    prompts, outs = workload(args.num_requests, cfg.vocab_size, cap_out=args.cap_out)
    RESULTS["workload"] = {"requests": len(prompts), "mean_in": float(np.mean([len(p) for p in prompts])),
                           "mean_out": float(np.mean(outs)), "max_in": max(map(len, prompts)), "max_out": max(outs)}
    print("workload", RESULTS["workload"], flush=True)

    if "baseline" not in skip:
        nb = args.baseline_requests
        try:
            RESULTS["hf_baseline"] = hf_baseline(cfg, prompts[:nb], outs[:nb], device, args.baseline_batch)
        except Exception as exc:
            RESULTS["hf_baseline"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        print("hf baseline", RESULTS["hf_baseline"], flush=True)
        free()
        save()

    if "gemm" not in skip and device.type == "cuda":
        try:
            RESULTS["gemm_batch1"] = gemm_batch1(cfg, device)
        except Exception as exc:
            RESULTS["gemm_error"] = f"{type(exc).__name__}: {exc}"
        print("gemm batch 1", json.dumps(RESULTS.get("gemm_batch1") or RESULTS.get("gemm_error")), flush=True)
        save()
    if "engine" not in skip:
        engine_section("engine", cfg, device, args, prompts, outs, False, bw)
    if "compile" not in skip:
        try:
            engine_section("engine_compiled", cfg, device, args, prompts if args.compile_throughput else None, outs,
                           True, bw)
        except Exception as exc:
            RESULTS["engine_compiled"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            print("compile failed", RESULTS["engine_compiled"]["error"], flush=True)
        save()
    table()


def table() -> None:
    R = RESULTS
    bw = R["copy_bandwidth_Bps"]
    lines = [f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + written)"]
    for p in R.get("parity", []):
        if "error" in p or "skipped" in p:
            lines.append(f"parity {p['model']}: {p.get('error') or p.get('skipped')}")
            continue
        lines.append(f"parity {p['model']:<22} fp32 graphs {p['fp32_graphs_match']}/{p['n_prompts']} eager "
                     f"{p['fp32_eager_match']}/{p['n_prompts']}  fp32-HF max|dlogit| {p['fp32_vs_hf_max_logit_diff']:.2e}  "
                     f"bf16 max|dlogit| {p['bf16_max_logit_diff']:.3f} (max|logit| {p['bf16_max_abs_logit']:.1f}, "
                     f"rel {p['bf16_rel_diff']:.1e}, top1 {p['bf16_top1_agree']:.2f})")
    hb = R.get("hf_baseline", {})
    if "output_tok_s" in hb:
        lines.append(f"HF generate static batch {hb['batch']} x {hb['requests']} req: {hb['output_tok_s']:.0f} out tok/s "
                     f"({hb['seconds']:.1f} s)")
    for label in ("engine", "engine_compiled"):
        e = R.get(label)
        if not e:
            continue
        if "error" in e:
            lines.append(f"{label}: {e['error']}")
            continue
        s = e.get("single", {})
        lines.append(f"{label}: batch-1 {s.get('ms_per_token_median', float('nan')):.2f} ms/tok, roofline "
                     f"{e['roofline_ms']:.2f} ms -> {100 * s.get('fraction_of_roofline', 0):.0f}% of roofline "
                     f"(floor 75%)")
        hb1 = e.get("host_breakdown_b1", {})
        if "whole_step_us_median" in hb1:
            lines.append(f"{label}: batch-1 host us " + ", ".join(
                f"{k[:-10]} {v:.0f}" for k, v in hb1.items()))
        if "replay_ms" in e:
            lines.append(f"{label}: graph replay ms " + ", ".join(f"b{k}={v:.2f}" for k, v in e["replay_ms"].items()))
        t = e.get("throughput")
        if t:
            ratio = t["output_tok_s"] / hb["output_tok_s"] if "output_tok_s" in hb else float("nan")
            lines.append(f"{label}: {t['requests']} req {t['output_tok_s']:.0f} out tok/s ({t['seconds']:.1f} s, "
                         f"{t['steps']} steps, {t['graph_steps']} graph) = {ratio:.1f}x HF (floors 8x, 8000)")
    gb = R.get("gemm_batch1")
    if gb:
        lines.append("batch-1 GEMMs (cuBLAS, ms @ TB/s read): " + ", ".join(
            f"{k} {v['ms']:.3f}@{v['read_TBps']:.2f}" for k, v in gb.items() if isinstance(v, dict)))
        lines.append(f"batch-1 GEMM sum: separate {gb['model_ms_separate']:.2f} ms, fused qkv/gate_up "
                     f"{gb['model_ms_fused']:.2f} ms")
    for label in ("engine", "engine_compiled"):
        p = (R.get(label) or {}).get("profile_eager_b1")
        if p and "gpu_us_total" in p:
            lines.append(f"{label} eager batch-1 step profile: {p['gpu_us_total'] / 1e3:.2f} ms GPU in {p['kernels']} "
                         f"kernels, GEMM {p['gemm_us'] / 1e3:.2f} ms")
    print("\n".join(lines), flush=True)
    R["table"] = lines
    save()


if __name__ == "__main__":
    main()
