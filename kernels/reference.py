"""Plain-PyTorch references of the paged KV-cache kernels.

These define the semantics that the Triton kernels in this package must match,
and they are the attention backend the engine uses on the CPU.

Cache layout: ``k_cache``/``v_cache`` are ``(num_blocks, block_size, num_kv_heads,
head_dim)``; a token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the K/V of new tokens into their cache slots, in place.

    Args:
        key, value: ``(num_tokens, num_kv_heads, head_dim)``, the cache's dtype.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        slot_mapping: ``(num_tokens,)`` int32/int64 slot per token; ``-1`` skips
            the token (padded rows).
    """
    num_blocks, block_size = k_cache.shape[:2]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # padded rows: drop them
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv_ref(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Gather one sequence's first ``seq_len`` cached tokens.

    Args:
        cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        block_table: ``(max_blocks,)`` int block ids (entries past the sequence
            are ignored).
        seq_len: number of tokens to gather.

    Returns:
        ``(seq_len, num_kv_heads, head_dim)``.
    """
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # (n_blocks, block_size, H_kv, D)
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens against their paged context (prefill and decode).

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
    these are the *last* ``q_len_i`` tokens of its ``seq_lens[i]`` cached tokens
    (their K/V must already be stored). Query row ``j`` of the sequence sits at
    position ``seq_lens[i] - q_len_i + j`` and attends to positions ``<=`` its own.
    A decode step is the case ``q_len_i == 1``.

    Args:
        query: ``(num_tokens, num_heads, head_dim)``.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``;
            ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA).
        block_tables: ``(num_seqs, max_blocks)`` int32.
        seq_lens: ``(num_seqs,)`` int32, context length including the new tokens.
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``(num_tokens, num_heads, head_dim)`` in ``query``'s dtype; computed in fp32.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q = query[qsl[i] : qsl[i + 1]]  # (q_len, H, D)
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[i], seq_len)  # (L, H_kv, D)
        v = gather_kv_ref(v_cache, block_tables[i], seq_len)
        k = k.repeat_interleave(group, dim=1).float()  # (L, H, D)
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # (H, q_len, L)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qsl[i] : qsl[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its whole paged context.

    Batched over sequences: the contexts are gathered into a padded
    ``(num_seqs, max_len, H_kv, D)`` tensor and masked by length.

    Args:
        query: ``(num_seqs, num_heads, head_dim)``.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        block_tables: ``(num_seqs, max_blocks)`` int32.
        seq_lens: ``(num_seqs,)`` int32, >= 1.
        scale: softmax scale.

    Returns:
        ``(num_seqs, num_heads, head_dim)`` in ``query``'s dtype.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    bt = block_tables[:, :n_blocks].long().clamp_min(0)
    # (B, n_blocks * block_size, H_kv, D)
    k = k_cache[bt].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    v = v_cache[bt].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    q = query.view(num_seqs, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,blhd->bhgl", q, k.float()) * scale  # (B, H_kv, G, L)
    positions = torch.arange(max_len, device=seq_lens.device)
    pad = positions.unsqueeze(0) >= seq_lens.unsqueeze(1).long()  # (B, L)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def copy_blocks_ref(
    src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Copy whole blocks ``src[m[0]] -> dst[m[1]]`` for each row of the mapping.

    Used for swap out (GPU pool -> pinned CPU pool) and swap in (back).

    Args:
        src, dst: ``(num_blocks_*, block_size, num_kv_heads, head_dim)``, same
            dtype and block shape; may live on different devices.
        block_mapping: ``(num_pairs, 2)`` int64 ``(src_block, dst_block)``.
    """
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].to(src.device)
    dst_ids = block_mapping[:, 1].to(dst.device)
    dst[dst_ids] = src[src_ids].to(dst.device)
