"""store_kvcache against store_kvcache_ref."""

import pytest
import torch

from tests.kernels.helpers import DEVICE
from kernels.reference import store_kvcache_ref
from kernels.store_kv import store_kvcache


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
def test_store_kvcache_matches_reference(kv, head_dim, block_size, num_kv_heads):
    num_blocks, num_tokens = 6, 40
    slots = torch.randperm(num_blocks * block_size, generator=kv.gen)[:num_tokens]
    slots[::7] = -1  # padded tokens are skipped
    slot_mapping = slots.to(DEVICE)
    key = kv.randn(num_tokens, num_kv_heads, head_dim)
    value = kv.randn(num_tokens, num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_store_kvcache_casts_and_accepts_strided_views(kv):
    num_tokens, heads, head_dim = 9, 2, 16
    qkv = kv.randn(num_tokens, 3 * heads, head_dim)  # fused projection output
    key, value = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    k_cache = torch.full((2, 16, heads, head_dim), float("nan"), dtype=torch.bfloat16,
                         device=DEVICE)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.arange(3, 3 + num_tokens, device=DEVICE)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    # One bf16 ulp: Triton's interpreter rounds fp32 -> bf16 toward zero.
    torch.testing.assert_close(k_cache, k_ref, rtol=2**-7, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=2**-7, atol=0, equal_nan=True)


def test_store_kvcache_rejects_mismatched_heads(kv):
    key = kv.randn(4, 2, 8)
    cache = kv.randn(2, 16, 3, 8)
    with pytest.raises(ValueError):
        store_kvcache(key, key, cache, cache.clone(), torch.arange(4, device=DEVICE))
