"""Paged prefill / context attention (Triton): varlen causal queries, paged K/V.

Covers prefill, chunked prefill and prefix-cache hits: the new tokens of each
sequence attend causally to themselves and to every cached token before them,
all read through the block table. FlashAttention-2's tiling and online softmax
(Dao, 2023) over KV tiles gathered PagedAttention-style (Kwon et al., SOSP 2023).

Grid: one program per (query tile, query head). Query tiles of all sequences are
numbered ``query_start_loc[i] // BLOCK_M + i + j`` (the numbering of vLLM's
unified Triton attention), so the grid size ``num_tokens // BLOCK_M + num_seqs``
is known without reading lengths back from the device; a program finds its
sequence by binary search and leaves at once if its tile is past the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_tile(
    acc, l_i, m_i,  # (BLOCK_M, BLOCK_D), (BLOCK_M,), (BLOCK_M,) fp32 running state
    q, q_pos,  # (BLOCK_M, BLOCK_D), (BLOCK_M,)
    pos, kv_end,  # (BLOCK_N,) KV positions of this tile; causal bound of the q tile
    bt_row, k_cache_ptr, v_cache_ptr, kv_head, stride_cb, stride_cs, stride_ch,
    offs_d, mask_d, scale_log2,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step over a KV tile gathered through the block table."""
    mask_n = pos < kv_end
    page = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    kv_row = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:  # interpreter: its tl.dot multiplies bf16 bit patterns as integers
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) fp32
    s = s * scale_log2
    if MASKED:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    # Position 0 is in the first tile and visible to every row: m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)  # (BLOCK_M, BLOCK_D)
    return acc * alpha[:, None] + pv, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr,  # (T, H, D)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    block_tables_ptr,  # (S, max_blocks)
    seq_lens_ptr,  # (S,)
    qsl_ptr,  # (S + 1,)
    out_ptr,  # (T, H, D)
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    # Largest seq with first tile <= this tile; the first tiles strictly increase.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_M + seq)
    if q_tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len  # cached tokens before the new ones
        offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows in the seq
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        q_pos = ctx_len + offs_m  # (BLOCK_M,) absolute positions
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        if UPCAST:  # interpreter: its tl.dot multiplies bf16 bit patterns as integers
            q = q.to(tl.float32)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_M)  # causal bound
        # Tiles wholly before the first query row need no mask (FlashAttention-2 sec. 3.1.1).
        full_end = (ctx_len + q_tile * BLOCK_M) // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, n0 + offs_n, kv_end, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head, stride_cb, stride_cs, stride_ch, offs_d, mask_d, scale_log2,
                BLOCK_SIZE, False, IEEE, UPCAST)
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, n0 + offs_n, kv_end, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head, stride_cb, stride_cs, stride_ch, offs_d, mask_d, scale_log2,
                BLOCK_SIZE, True, IEEE, UPCAST)
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens against their paged context (varlen batch).

    Same semantics as :func:`kernels.reference.paged_attention_ref`: sequence ``i``
    owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the *last*
    ``q_len_i`` of its ``seq_lens[i]`` tokens, whose K/V are already stored; row
    ``j`` sits at position ``seq_lens[i] - q_len_i + j`` and sees positions ``<=``
    its own. Accumulates in fp32. Decode steps (``q_len == 1``) are valid too.

    Args:
        query: ``(num_tokens, num_heads, head_dim)`` fp16/bf16/fp32, last dim contiguous.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``,
            contiguous, ``query``'s dtype; ``num_heads % num_kv_heads == 0``.
        block_tables: ``(num_seqs, max_blocks)`` int32.
        seq_lens: ``(num_seqs,)`` int32, tokens including the new ones.
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative query lengths,
            starting at 0 (empty sequences allowed).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        block_m, block_n, num_warps, num_stages: tuning knobs (query rows and
            KV tokens per tile, >= 16; Triton launch options).
        out: optional preallocated result ``(num_tokens, num_heads, head_dim)``, ``query``'s
            dtype, last dim contiguous.

    Returns:
        ``(num_tokens, num_heads, head_dim)`` in ``query``'s dtype.

    Raises:
        ValueError: on inconsistent shapes or strides.
    """
    num_tokens, num_heads, head_dim = query.shape  # (T, H, D)
    _, block_size, num_kv_heads, _ = k_cache.shape  # (N, BS, H_kv, D)
    num_seqs = seq_lens.shape[0]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit query {tuple(query.shape)}")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} / block_tables "
                         f"{tuple(block_tables.shape)} do not match {num_seqs} sequences")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or query.stride(2) != 1 \
            or block_tables.stride(1) != 1:
        raise ValueError("caches must be contiguous; query and block_tables need a "
                         "contiguous last dim")
    if out is None:
        out = torch.empty_like(query)  # (T, H, D)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {out.dtype}{tuple(out.shape)} does not match query")
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * 1.4426950408889634, num_seqs,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=query.dtype == torch.float32, UPCAST=query.device.type == "cpu",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
