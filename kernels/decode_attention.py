"""Paged decode attention (Triton): one query token per sequence.

Algorithm: PagedAttention's block-table gather (Kwon et al., SOSP 2023) with
Flash-Decoding's split of the context into independent chunks whose partial
results are merged by their log-sum-exp (Dao, Haziza, Massa, Sizov,
"Flash-Decoding for long-context inference", 2023), and FlashAttention-2's
online softmax inside each chunk (Dao, 2023).

GQA: one program owns one (sequence, KV head, split) and all ``group`` query
heads that share the KV head, so every K/V block is read once per group; the
group is padded to 16 rows so that both products go through ``tl.dot``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Fewer tokens than this per split and the merge costs more than the split gains.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, H, D)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    block_tables_ptr,  # (B, max_blocks)
    seq_lens_ptr,  # (B,)
    out_ptr,  # (B, H, D), written when SINGLE_SPLIT
    part_out_ptr,  # (B, H, num_splits, BLOCK_D) fp32, normalised per split
    part_lse_ptr,  # (B, H, num_splits) fp32, log2-sum-exp2 of each split
    scale_log2,  # softmax scale * log2(e)
    num_splits,  # runtime, so that split counts share one compiled kernel
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Splits own whole pages so that a page is never read by two programs.
    pages_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE), num_splits)
    start = split * pages_per_split * BLOCK_SIZE
    end = tl.minimum(start + pages_per_split * BLOCK_SIZE, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # (BLOCK_G,)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    if UPCAST:  # interpreter: its tl.dot multiplies bf16 bit patterns as integers
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n  # (BLOCK_N,) token positions
        mask_n = pos < end
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # (BLOCK_G, BLOCK_N) fp32
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (BLOCK_G, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # (BLOCK_G, BLOCK_D)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0  # an empty split (short sequence) leaves l_i == 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        row_s = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # (BLOCK_G,)
        tl.store(part_out_ptr + row_s[:, None] * BLOCK_D + offs_d[None, :], out,
                 mask=mask_g[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row_s, lse, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,  # (B, H, NUM_SPLITS, BLOCK_D) fp32
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32
    out_ptr,  # (B, H, D)
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    base = b * tl.num_programs(1) + h
    lse = tl.load(part_lse_ptr + base * NUM_SPLITS + offs_s, mask=mask_s,
                  other=float("-inf"))  # (BLOCK_S,)
    # Split 0 always holds the first token, so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))  # (BLOCK_S,), 0 for empty splits
    o = tl.load(part_out_ptr + (base * NUM_SPLITS + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                mask=mask_s[:, None], other=0.0)  # (BLOCK_S, BLOCK_D)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)  # (BLOCK_D,)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter runs: few splits keep the CPU tests fast
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                       device: torch.device) -> int:
    """Splits per sequence so that about two waves of programs fill the GPU.

    Uses ``max_context`` (tokens; the block table's width times the block size is
    a safe bound) rather than the true lengths, so it needs no device sync and is
    stable under CUDA-graph capture.
    """
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * _sm_count(device), programs)
    most = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, most, _MAX_SPLITS))


def _check(query, k_cache, v_cache, block_tables, seq_lens):
    num_seqs, num_heads, head_dim = query.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not "
                         f"match head_dim {head_dim}")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{k_cache.shape[2]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match {num_seqs} sequences")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or query.stride(2) != 1 \
            or block_tables.stride(1) != 1:
        raise ValueError("caches must be contiguous; query and block_tables need a "
                         "contiguous last dim")


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one new token per sequence against its paged context.

    Same semantics as :func:`kernels.reference.paged_decode_attention_ref`; K/V of
    the new token must already be stored. Accumulates in fp32.

    Args:
        query: ``(num_seqs, num_heads, head_dim)`` fp16/bf16/fp32, last dim contiguous.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``,
            contiguous, ``query``'s dtype; ``num_heads % num_kv_heads == 0``.
        block_tables: ``(num_seqs, max_blocks)`` int32; entries past a sequence's
            last block are never read.
        seq_lens: ``(num_seqs,)`` int32, each ``>= 1`` (tokens, new one included).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        num_splits: context chunks per sequence (Flash-Decoding); ``None`` picks
            :func:`default_num_splits`, ``1`` skips the merge kernel.
        block_n, num_warps, num_stages: tuning knobs (tokens per loop step,
            default 64 or fewer for wide heads; Triton launch options).
        out: optional preallocated result ``(num_seqs, num_heads, head_dim)``, ``query``'s
            dtype, last dim contiguous (e.g. a CUDA-graph buffer).

    Returns:
        ``(num_seqs, num_heads, head_dim)`` in ``query``'s dtype.

    Raises:
        ValueError: on inconsistent shapes, strides or ``num_splits < 1``.
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape  # (B, H, D)
    _, block_size, num_kv_heads, _ = k_cache.shape  # (N, BS, H_kv, D)
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads,
                                        block_tables.shape[1] * block_size, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(query)  # (B, H, D)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {out.dtype}{tuple(out.shape)} does not match query")
    if num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = max(16, triton.next_power_of_2(group))
    if block_n is None:
        block_n = 64 if block_d * block_g <= 128 * 16 else 32
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * 1.4426950408889634, num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SINGLE_SPLIT=num_splits == 1,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32, UPCAST=query.device.type == "cpu",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out
