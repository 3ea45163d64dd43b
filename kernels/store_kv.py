"""Store the K/V of new tokens into the paged cache (Triton).

One program per token copies that token's ``num_kv_heads * head_dim`` keys and
values into slot ``slot_mapping[t]``; the scatter follows vLLM's
``reshape_and_cache`` (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr,  # (T, H_kv, D)
    k_cache_ptr, v_cache_ptr,  # (num_blocks * block_size, H_kv, D) as flat slots
    slot_ptr,  # (T,)
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1 marks a padded token: nothing to store
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                    mask=mask)  # (BLOCK_H, BLOCK_D)
        v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask)
        dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the K/V of new tokens into their cache slots, in place.

    Same semantics as :func:`kernels.reference.store_kvcache_ref`. A token's slot
    is ``block_id * block_size + offset``; slot ``-1`` skips the token.

    Args:
        key, value: ``(num_tokens, num_kv_heads, head_dim)``; any float dtype (cast
            to the cache's); the last dim must be contiguous, other strides free
            (e.g. views of a fused QKV projection).
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``,
            contiguous, same dtype and shape.
        slot_mapping: ``(num_tokens,)`` int32/int64 on the caches' device.

    Raises:
        ValueError: on mismatched shapes, non-contiguous caches or a last dim
            that is not contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape  # (T, H_kv, D)
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} disagree")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not "
                         f"match K/V heads {num_kv_heads} x {head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value need a contiguous last dim")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
