"""Kernel benchmark for the GPU: correctness first, then paged decode and swap timings.

Run on the device machine:
    PYTHONUNBUFFERED=1 python3 benchmarks/bench_kernels.py --out $OUT [--sweep]

1. Every kernel against its plain-PyTorch reference (bf16 and fp32, fresh inputs,
   outputs poisoned with NaN first).
2. Ceilings measured in the same run: device-to-device copy bandwidth (bytes read
   + written of a large ``torch`` copy) and pinned host<->device copy bandwidth.
3. Paged decode attention, head_dim 128, 32 query / 8 KV heads, block 16, bf16,
   batch {1, 32, 128} x context {512, 2048, 8192}, scattered block tables: median
   time, K/V bytes read per second over the copy bandwidth, and SDPA on the same
   K/V stored contiguously (``enable_gqa=True``, and with K/V heads repeated).
4. copy_blocks GPU <-> pinned CPU against the plain pinned copy.
A short table is printed last; everything goes to ``--out/bench_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kernels.copy_blocks as kcb  # noqa: E402
from kernels.copy_blocks import copy_blocks  # noqa: E402
from kernels.decode_attention import default_num_splits, paged_decode_attention  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from kernels.reference import (copy_blocks_ref, paged_attention_ref,  # noqa: E402
                               paged_decode_attention_ref, store_kvcache_ref)
from kernels.store_kv import store_kvcache  # noqa: E402

DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def bench(fn) -> float:
    """Median milliseconds (CUDA events) of eager calls: includes any launch gaps."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn, reps: int = 10) -> float:
    """Median milliseconds per call of ``reps`` calls captured in one CUDA graph.

    Decode runs under CUDA graphs in the engine, so this is the GPU time that
    counts; it removes the host's launch overhead (Triton's launcher costs tens
    of microseconds of Python per launch).
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return bench(graph.replay) / reps


def host_us(fn, n: int = 200) -> float:
    """Host microseconds per call when the GPU keeps up (launch overhead)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def rel_err(out, ref) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def paged_setup(seq_lens, block_size, num_kv_heads, head_dim, dtype, shuffle=True):
    """Random caches just large enough, and block tables of scattered blocks."""
    need = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(need)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEV, dtype=dtype)
    v_cache = torch.randn(shape, device=DEV, dtype=dtype)
    perm = torch.randperm(num_blocks, device=DEV) if shuffle else torch.arange(num_blocks, device=DEV)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n].int()
        used += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return k_cache, v_cache, table, lens


def check_correctness() -> list[dict]:
    rows = []

    def record(name, dtype, err, tol):
        ok = err == err and err < tol
        rows.append({"check": name, "dtype": str(dtype).split(".")[-1], "rel_err": err, "ok": ok})
        print(f"  {'ok ' if ok else 'BAD'} {name:48s} {str(dtype):15s} {err:.2e}")

    for dtype in (torch.bfloat16, torch.float32):
        for head_dim, block_size, group in ((128, 16, 4), (64, 32, 2), (8, 16, 1), (128, 32, 8)):
            seq_lens = [1, block_size, 4 * block_size, 1000, 3 * block_size + 7]
            k, v, bt, lens = paged_setup(seq_lens, block_size, 2, head_dim, dtype)
            q = torch.randn(len(seq_lens), 2 * group, head_dim, device=DEV, dtype=dtype)
            ref = paged_decode_attention_ref(q, k, v, bt, lens, head_dim**-0.5)
            for splits in (1, None, 7):
                out = torch.full_like(q, float("nan"))
                paged_decode_attention(q, k, v, bt, lens, head_dim**-0.5, num_splits=splits, out=out)
                record(f"decode D{head_dim} BS{block_size} G{group} splits={splits}", dtype,
                       rel_err(out, ref), TOL[dtype])
            # prefill: full prompt, prefix hit, chunk, decode row
            q_lens = [1, block_size, 2 * block_size, 300, 7]
            qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
            qsl[1:] = torch.tensor(q_lens).cumsum(0)
            qsl = qsl.to(DEV)
            qp = torch.randn(int(qsl[-1]), 2 * group, head_dim, device=DEV, dtype=dtype)
            out = torch.full_like(qp, float("nan"))
            paged_prefill_attention(qp, k, v, bt, lens, qsl, head_dim**-0.5, out=out)
            ref = paged_attention_ref(qp, k, v, bt, lens, qsl, head_dim**-0.5)
            record(f"prefill D{head_dim} BS{block_size} G{group}", dtype, rel_err(out, ref), TOL[dtype])
            # store_kvcache with padded slots
            slots = torch.randperm(k.shape[0] * block_size, device=DEV)[:200]
            slots[::9] = -1
            key = torch.randn(200, 2, head_dim, device=DEV, dtype=dtype)
            val = torch.randn_like(key)
            kc, vc = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            kr, vr = kc.clone(), vc.clone()
            store_kvcache(key, val, kc, vc, slots)
            store_kvcache_ref(key, val, kr, vr, slots)
            same = torch.equal(kc.nan_to_num(7.0), kr.nan_to_num(7.0)) and \
                torch.equal(vc.nan_to_num(7.0), vr.nan_to_num(7.0))
            record(f"store_kvcache D{head_dim} BS{block_size}", dtype, 0.0 if same else 1.0, 0.5)
        # copy_blocks: GPU->GPU (Triton), swap out / in through pinned memory
        gpu = torch.randn(64, 16, 8, 128, device=DEV, dtype=dtype)
        cpu = torch.randn(96, 16, 8, 128, dtype=dtype).pin_memory()
        for name, src, dst_like, n_dst in (("gpu->gpu", gpu, gpu, 64), ("swap out", gpu, cpu, 96),
                                           ("swap in", cpu, gpu, 64)):
            mapping = torch.stack([torch.randperm(src.shape[0])[:20], torch.randperm(n_dst)[:20]], 1)
            dst = torch.full_like(dst_like, float("nan"))
            if dst.device.type == "cpu":
                dst = dst.pin_memory()
            ref = dst.clone()
            copy_blocks(src, dst, mapping)
            torch.cuda.synchronize()
            copy_blocks_ref(src, ref, mapping)
            same = torch.equal(dst.nan_to_num(7.0), ref.nan_to_num(7.0))
            record(f"copy_blocks {name}", dtype, 0.0 if same else 1.0, 0.5)
    return rows


def copy_bandwidth() -> dict:
    n = 1 << 30  # 1 GiB bf16-free byte count: 2 GiB moved per copy
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    b = torch.empty_like(a)
    d2d = 2 * n / (bench(lambda: b.copy_(a)) * 1e-3)
    h = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    g = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    h2d = h.numel() / (bench(lambda: g.copy_(h, non_blocking=True)) * 1e-3)
    d2h = h.numel() / (bench(lambda: h.copy_(g, non_blocking=True)) * 1e-3)
    del a, b
    return {"d2d_bytes_per_s": d2d, "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h}


def bench_decode(batch, ctx, copy_bw, sweep) -> dict:
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    dtype = torch.bfloat16
    k, v, bt, lens = paged_setup([ctx] * batch, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(batch, heads, head_dim, device=DEV, dtype=dtype)
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
    splits = default_num_splits(batch, kv_heads, bt.shape[1] * block_size, q.device)
    ours = lambda: paged_decode_attention(q, k, v, bt, lens, scale)  # noqa: E731
    eager_ms = bench(ours)
    ms = bench_graph(ours)
    host = host_us(ours)
    # SDPA on the same K/V stored contiguously: (B, H_kv, L, D)
    kc = k[bt.long()].reshape(batch, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(batch, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)  # (B, H, 1, D)
    sdpa_gqa = bench_graph(lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True))
    sdpa_gqa_eager = bench(lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True))
    kr, vr = kc.repeat_interleave(heads // kv_heads, 1), vc.repeat_interleave(heads // kv_heads, 1)
    sdpa_rep = bench_graph(lambda: F.scaled_dot_product_attention(q4, kr, vr))
    ref = F.scaled_dot_product_attention(q4.float(), kr.float(), vr.float()).squeeze(2)
    err = rel_err(paged_decode_attention(q, k, v, bt, lens, scale), ref)
    del kr, vr
    row = {"batch": batch, "context": ctx, "num_splits": splits, "ms": ms, "rel_err": err,
           "eager_ms": eager_ms, "host_us_per_call": host, "sdpa_gqa_eager_ms": sdpa_gqa_eager,
           "kv_bytes": kv_bytes, "frac_copy_bw": kv_bytes / (ms * 1e-3) / copy_bw,
           "sdpa_gqa_ms": sdpa_gqa, "sdpa_repeat_kv_ms": sdpa_rep, "vs_sdpa_gqa": ms / sdpa_gqa,
           "sdpa_gqa_frac_copy_bw": kv_bytes / (sdpa_gqa * 1e-3) / copy_bw}
    if sweep:
        row["sweep"] = []
        for s in sorted({1, 2, 3, 4, 8, 16, 32, splits}):
            for bn, nw, ns in ((64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 8, 3), (32, 4, 3),
                               (64, 4, 4)):
                t = bench_graph(lambda: paged_decode_attention(q, k, v, bt, lens, scale, num_splits=s,
                                                         block_n=bn, num_warps=nw, num_stages=ns))
                row["sweep"].append({"splits": s, "block_n": bn, "num_warps": nw,
                                     "num_stages": ns, "ms": t})
        best = min(row["sweep"], key=lambda r: r["ms"])
        row["sweep_best"] = best
        print(f"  sweep B{batch} L{ctx}: default {ms*1e3:.1f} us, best {best}")
    return row


def bench_prefill(copy_bw) -> dict:
    seqs, q_len, heads, kv_heads, head_dim = 4, 2048, 32, 8, 128
    k, v, bt, lens = paged_setup([q_len] * seqs, 16, kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(seqs * q_len, heads, head_dim, device=DEV, dtype=torch.bfloat16)
    qsl = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32, device=DEV)
    ms = bench(lambda: paged_prefill_attention(q, k, v, bt, lens, qsl, head_dim**-0.5))
    sweep = []
    for bm, bn, nw, ns in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                           (64, 128, 4, 2), (128, 32, 4, 3), (64, 64, 4, 3)):
        t = bench(lambda: paged_prefill_attention(q, k, v, bt, lens, qsl, head_dim**-0.5,
                                                  block_m=bm, block_n=bn, num_warps=nw,
                                                  num_stages=ns))
        sweep.append({"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns, "ms": t})
    print("  prefill sweep:", sorted((round(r["ms"] * 1e3), r["block_m"], r["block_n"],
                                      r["num_warps"], r["num_stages"]) for r in sweep))
    qd = q.view(seqs, q_len, heads, head_dim).transpose(1, 2)
    kc = k[bt.long()].reshape(seqs, -1, kv_heads, head_dim).transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(seqs, -1, kv_heads, head_dim).transpose(1, 2).contiguous()
    sdpa = bench(lambda: F.scaled_dot_product_attention(qd, kc, vc, is_causal=True, enable_gqa=True))
    flops = 4 * seqs * heads * head_dim * q_len * q_len / 2
    return {"seqs": seqs, "q_len": q_len, "ms": ms, "sdpa_causal_gqa_ms": sdpa, "sweep": sweep,
            "tflops": flops / ms / 1e9, "sdpa_tflops": flops / sdpa / 1e9}


def bench_swap(bw) -> list[dict]:
    block = (16, 8, 128)  # one layer's block: 32 KiB in bf16
    gpu = torch.randn(8192, *block, device=DEV, dtype=torch.bfloat16)
    cpu = torch.randn(8192, *block, dtype=torch.bfloat16).pin_memory()
    n = 2048
    nbytes = n * gpu[0].numel() * 2
    rows = []
    gpu_ids = torch.randperm(8192)[:n]
    default_runs = kcb._MAX_DMA_RUNS
    for layout, cpu_ids in (("contiguous cpu ids", torch.arange(1000, 1000 + n)),
                            ("scattered cpu ids", torch.randperm(8192)[:n])):
        out_map = torch.stack([gpu_ids, cpu_ids], 1)
        in_map = out_map.flip(1).contiguous()
        for path, max_runs in (("auto", default_runs), ("DMA runs", 10**9), ("zero-copy", 0)):
            kcb._MAX_DMA_RUNS = max_runs
            kcb._ZERO_COPY_SWAP_IN = path != "DMA runs"
            # correctness of this path, then time
            cpu[cpu_ids] = float("nan")
            copy_blocks(gpu, cpu, out_map)
            torch.cuda.synchronize()
            ok = torch.equal(cpu[cpu_ids], gpu[gpu_ids].cpu())
            t_out = bench(lambda: copy_blocks(gpu, cpu, out_map))
            t_in = bench(lambda: copy_blocks(cpu, gpu, in_map))
            for d, t, key in (("out", t_out, "d2h_bytes_per_s"), ("in", t_in, "h2d_bytes_per_s")):
                rows.append({"case": f"swap {d}, {layout}, {path}", "ms": t, "bytes": nbytes,
                             "ok": ok, "frac_pinned_bw": nbytes / (t * 1e-3) / bw[key]})
    kcb._MAX_DMA_RUNS = default_runs
    kcb._ZERO_COPY_SWAP_IN = True
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", action="store_true", help="also sweep splits and tiles")
    args = parser.parse_args()
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    t0 = time.time()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(env)
    print("correctness:")
    checks = check_correctness()
    bw = copy_bandwidth()
    print({k: f"{v/1e9:.1f} GB/s" for k, v in bw.items()})
    decode = []
    for batch in (1, 32, 128):
        for ctx in (512, 2048, 8192):
            sweep = args.sweep and (batch, ctx) in {(1, 8192), (32, 2048), (32, 8192),
                                                    (128, 2048), (128, 8192)}
            decode.append(bench_decode(batch, ctx, bw["d2d_bytes_per_s"], sweep))
            torch.cuda.empty_cache()
    prefill = bench_prefill(bw["d2d_bytes_per_s"])
    swap = bench_swap(bw)
    result = {"env": env, "checks": checks, "bandwidth": bw, "decode": decode,
              "prefill": prefill, "swap": swap, "seconds": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"\nprefill 4x2048 causal: ours {prefill['ms']*1e3:.0f} us ({prefill['tflops']:.0f} TFLOP/s), "
          f"SDPA {prefill['sdpa_causal_gqa_ms']*1e3:.0f} us")
    for r in swap:
        if "ms" in r:
            print(f"{r['case']:40s} {r['ms']*1e3:8.0f} us  {r['frac_pinned_bw']*100:5.1f}% of pinned copy")
        else:
            print(r)
    bad = [c["check"] + " " + c["dtype"] for c in checks if not c["ok"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok {bad if bad else ''}")
    print(f"copy d2d {bw['d2d_bytes_per_s']/1e12:.2f} TB/s, h2d {bw['h2d_bytes_per_s']/1e9:.1f} GB/s, "
          f"d2h {bw['d2h_bytes_per_s']/1e9:.1f} GB/s")
    print("decode, CUDA-graph replay (eager in brackets), us; SDPA bf16 enable_gqa=True on "
          "contiguous K/V; sdpa_rep = K/V heads repeated")
    print(f"{'B':>4} {'ctx':>5} {'splits':>6} {'ours':>7} {'(eager)':>8} {'%copyBW':>8} "
          f"{'sdpa':>7} {'(eager)':>8} {'sdpa_rep':>9} {'ours/sdpa':>9} {'host':>6} {'err':>8}")
    for r in decode:
        print(f"{r['batch']:>4} {r['context']:>5} {r['num_splits']:>6} {r['ms']*1e3:>7.1f} "
              f"{r['eager_ms']*1e3:>8.1f} {r['frac_copy_bw']*100:>7.1f}% {r['sdpa_gqa_ms']*1e3:>7.1f} "
              f"{r['sdpa_gqa_eager_ms']*1e3:>8.1f} {r['sdpa_repeat_kv_ms']*1e3:>9.1f} "
              f"{r['vs_sdpa_gqa']:>9.2f} {r['host_us_per_call']:>6.0f} {r['rel_err']:>8.1e}")


if __name__ == "__main__":
    main()
