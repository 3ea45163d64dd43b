"""Offline throughput on the CPU: our engine against transformers ``generate`` with static batches.

Same 32 requests (fixed seed, lognormal input/output lengths, EOS ignored so every
request produces exactly its output length) for both. The baseline runs the
requests in arrival order in static, left-padded batches; a batch generates until
its longest request is done, and only each request's own tokens count. Both are
float32 on this machine's CPU, in the same process, one after the other.

Usage: python benchmarks/bench_offline_cpu.py [--num-requests 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch


def make_requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    # Lognormal lengths shaped like ShareGPT's but scaled down for a 2-core CPU.
    inputs = np.clip(rng.lognormal(np.log(80), 0.7, n), 8, 400).astype(int)
    outputs = np.clip(rng.lognormal(np.log(90), 0.6, n), 8, 256).astype(int)
    return [(rng.integers(100, vocab - 100, int(i)).tolist(), int(o)) for i, o in zip(inputs, outputs)]


def run_engine(loaded, requests, **kwargs) -> dict:
    from engine import SamplingParams
    from engine.llm import LLM, engine_from_loaded

    llm = LLM.from_engine(engine_from_loaded(loaded, **kwargs))
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    llm.generate(prompts[:2], params[:2])  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in requests)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_per_s": n_out / dt}


@torch.inference_mode()
def run_hf_static(hf_dir, requests, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    pad = 0
    t0 = time.perf_counter()
    useful = 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(o for _, o in batch)
        gen = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=pad)
        model.generate(ids, attention_mask=mask, generation_config=gen)
        useful += sum(o for _, o in batch)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": useful, "output_tok_per_s": useful / dt, "batch_size": batch_size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-batch-sizes", default="8,32")
    ap.add_argument("--out", default="benchmarks/results/offline_cpu.json")
    args = ap.parse_args()

    from engine.loader import load_model

    loaded = load_model("smollm2-135m-instruct")
    requests = make_requests(args.num_requests, args.seed, loaded.config.vocab_size)
    ours = run_engine(loaded, requests, num_gpu_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048)
    baselines = [run_hf_static(loaded.hf_dir, requests, int(b)) for b in args.baseline_batch_sizes.split(",")]
    best = max(baselines, key=lambda b: b["output_tok_per_s"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "commit": commit, "model": "smollm2-135m-instruct (float32)", "num_requests": len(requests),
        "input_tokens": sum(len(p) for p, _ in requests), "ours": ours, "baselines": baselines,
        "speedup_vs_best_baseline": ours["output_tok_per_s"] / best["output_tok_per_s"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'system':<34}{'seconds':>9}{'out tok':>9}{'out tok/s':>11}")
    print(f"{'chatgate engine':<34}{ours['seconds']:>9.1f}{ours['output_tokens']:>9}{ours['output_tok_per_s']:>11.1f}")
    for b in baselines:
        print(f"{'transformers static, batch ' + str(b['batch_size']):<34}{b['seconds']:>9.1f}{b['output_tokens']:>9}{b['output_tok_per_s']:>11.1f}")
    print(f"speedup vs best baseline: {result['speedup_vs_best_baseline']:.2f}x")


if __name__ == "__main__":
    main()
