"""Tensor parallelism on two GPUs of one host: parity first, then TP=1 against TP=2.

Run on the device machine (kind nvidia-h200-x2, one call; NVLink multicast stays
off as the image sets it):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_tp.py --out $OUT

1. Parity: greedy token ids at TP=2 against TP=1 on stories260K (``.models/stories260k``,
   8 query / 4 KV heads) and a tiny random Llama with head_dim 128 (8 / 4 heads), in
   fp32 (ids must be equal) and bf16 (share of equal ids, and the largest
   difference of the chosen tokens' log-probabilities where the ids agree).
2. Llama-3-8B shape, dummy bf16 weights, at TP=1 and TP=2: single-stream decode
   (ms per token, batch 1) and offline throughput on the ShareGPT-like workload of
   ``bench_gpu_engine`` (output tokens/s).
A short table is printed last; JSON goes to ``--out/bench_tp.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_engine import copy_bandwidth, run_throughput, single_stream, workload  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.dummy_models import dummy_config, weight_bytes  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

RESULTS: dict = {}
OUT_PATH = ""
DEVICE = "cuda"
TP_GRAPHS = True  # CUDA graphs at TP > 1 (--no-tp-graphs: eager decode steps there)


def save() -> None:
    with open(OUT_PATH, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def tiny_hd128():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    c = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=128, num_hidden_layers=2, vocab_size=1000, max_position_embeddings=512,
                    tie_word_embeddings=False)
    hf = LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    cfg = ModelConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=512)
    return cfg, {k: v.detach().clone() for k, v in hf.state_dict().items()}


def greedy_with_logprobs(engine: LLMEngine, prompts, n: int):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = LLM.from_engine(engine).generate(prompts, params)
    return [(o.outputs[0].token_ids, [lp[0] for lp in o.outputs[0].logprobs]) for o in outs]


def parity(name, cfg, state_dict, prompts, n_new=24) -> dict:
    r: dict = {"model": name, "n_prompts": len(prompts), "new_tokens": n_new}
    for dtype in ("float32", "bfloat16"):
        got = {}
        for tp in (1, 2):
            ec = EngineConfig(dtype=dtype, device=DEVICE, tensor_parallel_size=tp, num_gpu_blocks=512,
                              max_num_seqs=16, compile_model=False, seed=0, cuda_graphs=TP_GRAPHS or tp == 1)
            engine = LLMEngine(cfg, state_dict, None, ec)
            try:
                got[tp] = greedy_with_logprobs(engine, prompts, n_new)
            finally:
                engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        same = [a[0] == b[0] for a, b in zip(got[1], got[2])]
        diffs = []
        for (ids1, lp1), (ids2, lp2) in zip(got[1], got[2]):
            for t1, t2, l1, l2 in zip(ids1, ids2, lp1, lp2):
                if t1 != t2:
                    break
                diffs.append(abs(l1 - l2))
        r[dtype] = {"sequences_equal": sum(same), "max_logprob_diff": max(diffs) if diffs else None}
        print(name, dtype, r[dtype], flush=True)
    r["pass"] = r["float32"]["sequences_equal"] == len(prompts)
    return r


def perf(tp: int, args, prompts, outs, bw: float) -> dict:
    cfg = dummy_config(args.model)
    t0 = time.perf_counter()
    ec = EngineConfig(dtype="bfloat16", device="cuda", block_size=16, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=8192, max_model_len=4096, gpu_memory_utilization=0.85,
                      enable_prefix_caching=False, swap_space_gb=1.0, seed=0, tensor_parallel_size=tp,
                      cuda_graphs=TP_GRAPHS or tp == 1)
    engine = LLMEngine(cfg, None, None, ec, model_name=args.model)
    torch.cuda.synchronize()
    r: dict = {"tp": tp, "init_s": time.perf_counter() - t0, "num_gpu_blocks": engine.block_manager.num_blocks}
    wb = weight_bytes(engine.runner.model)  # one rank's shard
    r["weight_bytes_per_rank"] = wb
    r["roofline_ms"] = 1e3 * wb / bw  # each rank reads its shard in parallel
    print(f"tp={tp} up", json.dumps(r), flush=True)
    try:
        r["single"] = single_stream(engine)
        r["single"]["fraction_of_roofline"] = r["roofline_ms"] / r["single"]["ms_per_token_median"]
        print(f"tp={tp} single", r["single"], flush=True)
        if prompts:
            r["throughput"] = run_throughput(engine, prompts, outs)
            print(f"tp={tp} throughput", r["throughput"], flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return r


def main() -> None:
    global OUT_PATH, DEVICE, TP_GRAPHS
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the parity part (gloo)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--stories", default=".models/stories260k")
    ap.add_argument("--skip", default="", help="comma list of: parity,tp1,tp2,throughput")
    ap.add_argument("--no-tp-graphs", action="store_true", help="eager decode steps at TP > 1")
    args = ap.parse_args()
    TP_GRAPHS = not args.no_tp_graphs
    skip = set(filter(None, args.skip.split(",")))
    DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    OUT_PATH = os.path.join(args.out, "bench_tp.json")
    RESULTS["env"] = {"torch": torch.__version__, "gpus": torch.cuda.device_count(),
                      "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "args": vars(args),
                      "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    bw = copy_bandwidth(DEVICE)
    RESULTS["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.device_count()} GPUs", flush=True)
    save()
    if "parity" not in skip:
        RESULTS["parity"] = []
        try:
            from engine.loader import load_model

            loaded = load_model(args.stories)
            ids = [loaded.tokenizer.encode(t) for t in (
                "Once upon a time", "Lily", "The dog ran to the park and saw a big red ball. He", "One day, a little bird",
                "Tom and his mom went to the store", "The sun", "There was a boy who loved to play", "Sue had a cat.")]
            RESULTS["parity"].append(parity("stories260k", loaded.config, loaded.state_dict, ids))
        except Exception as exc:
            RESULTS["parity"].append({"model": "stories260k", "error": f"{type(exc).__name__}: {exc}",
                                      "trace": traceback.format_exc()[-2500:]})
            print(RESULTS["parity"][-1], flush=True)
        save()
        try:
            cfg, sd = tiny_hd128()
            rng = np.random.default_rng(0)
            ids = [rng.integers(0, 1000, size=n).tolist() for n in (1, 2, 15, 16, 17, 33, 64, 100)]
            RESULTS["parity"].append(parity("tiny_llama_hd128_gqa2", cfg, sd, ids))
        except Exception as exc:
            RESULTS["parity"].append({"model": "tiny_llama_hd128_gqa2", "error": f"{type(exc).__name__}: {exc}",
                                      "trace": traceback.format_exc()[-2500:]})
            print(RESULTS["parity"][-1], flush=True)
        save()
    cfg = dummy_config(args.model)
    prompts, outs = workload(args.num_requests, cfg.vocab_size)
    if "throughput" in skip:
        prompts = None
    for tp in (1, 2):
        if f"tp{tp}" in skip:
            continue
        try:
            RESULTS[f"tp{tp}"] = perf(tp, args, prompts, outs, bw)
        except Exception as exc:
            RESULTS[f"tp{tp}"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            print(f"tp={tp} failed", RESULTS[f"tp{tp}"], flush=True)
        save()
    table()


def table() -> None:
    R = RESULTS
    lines = [f"copy bandwidth: {R['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (GPU 0, read + written); "
             f"{R['env']['gpus']} GPUs"]
    for p in R.get("parity", []):
        if "error" in p:
            lines.append(f"parity {p['model']}: {p['error']}")
            continue
        f, b = p["float32"], p["bfloat16"]
        lines.append(f"parity {p['model']:<24} TP2 vs TP1 fp32 {f['sequences_equal']}/{p['n_prompts']} equal "
                     f"(max |dlogprob| {f['max_logprob_diff']:.1e}); bf16 {b['sequences_equal']}/{p['n_prompts']} "
                     f"equal (max |dlogprob| {b['max_logprob_diff']:.3f})")
    for tp in (1, 2):
        e = R.get(f"tp{tp}")
        if not e:
            continue
        if "error" in e:
            lines.append(f"TP={tp}: {e['error']}")
            continue
        s, t = e.get("single", {}), e.get("throughput")
        line = (f"TP={tp}: batch-1 {s.get('ms_per_token_median', float('nan')):.2f} ms/tok (shard roofline "
                f"{e['roofline_ms']:.2f} ms, {100 * s.get('fraction_of_roofline', 0):.0f}%)")
        if t:
            line += f"; {t['requests']} req {t['output_tok_s']:.0f} out tok/s ({t['seconds']:.1f} s)"
        lines.append(line + f"; init {e['init_s']:.0f} s")
    print("\n".join(lines), flush=True)
    R["table"] = lines
    save()


if __name__ == "__main__":
    main()
