"""paged_decode_attention against paged_decode_attention_ref (and the varlen ref)."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, rel_err, tolerance
from kernels.decode_attention import default_num_splits, paged_decode_attention
from kernels.reference import paged_attention_ref, paged_decode_attention_ref


def _run(kv, head_dim, block_size, group, num_splits, dtype=torch.float32, num_kv_heads=2):
    # Lengths: 1, exact multiples of the block size, and ragged ones.
    seq_lens = [1, block_size, 3 * block_size, 2 * block_size + 5]
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    k_cache, v_cache = kv.caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    block_tables = kv.block_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = kv.randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype)
    out = torch.full_like(query, float("nan"))
    got = paged_decode_attention(query, k_cache, v_cache, block_tables, lens,
                                 head_dim**-0.5, num_splits=num_splits, out=out)
    assert got is out
    ref = paged_decode_attention_ref(query, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    assert rel_err(out, ref) < tolerance(dtype)
    return query, k_cache, v_cache, block_tables, lens, out


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(kv, head_dim, block_size, group, num_splits):
    _run(kv, head_dim, block_size, group, num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(kv, dtype):
    _run(kv, 64, 16, 4, 2, dtype=dtype)


def test_decode_more_splits_than_pages_and_odd_shapes(kv):
    # 8 splits over sequences of 1..4 pages: most splits are empty; group 8, 1 KV head.
    _run(kv, 96, 16, 8, 8, num_kv_heads=1)


def test_decode_agrees_with_varlen_reference(kv):
    query, k_cache, v_cache, block_tables, lens, out = _run(kv, 64, 16, 2, None)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, lens, qsl, 64**-0.5)
    assert rel_err(out, ref) < tolerance(torch.float32)


def test_default_num_splits_fills_the_gpu_without_tiny_splits():
    assert default_num_splits(1, 8, 512, torch.device("cpu")) >= 1
    assert default_num_splits(1, 8, 256, torch.device("cpu")) == 1  # one split per 256 tokens


def test_decode_rejects_bad_gqa(kv):
    k_cache, v_cache = kv.caches(4, 16, 3, 8, torch.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(kv.randn(1, 4, 8), k_cache, v_cache,
                               torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                               torch.ones(1, dtype=torch.int32, device=DEVICE), 1.0)
