"""paged_prefill_attention against paged_attention_ref: prefill, prefix hits, chunks."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, rel_err, tolerance
from kernels.prefill_attention import paged_prefill_attention
from kernels.reference import paged_attention_ref


def _run(kv, head_dim, block_size, group, seq_lens, q_lens, dtype=torch.float32,
         num_kv_heads=2, block_m=16, block_n=32):
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 2
    k_cache, v_cache = kv.caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    block_tables = kv.block_tables(seq_lens, block_size, num_blocks)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    qsl = qsl.to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = kv.randn(int(qsl[-1]), num_kv_heads * group, head_dim, dtype=dtype)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, k_cache, v_cache, block_tables, lens, qsl, head_dim**-0.5,
                            block_m=block_m, block_n=block_n, out=out)
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, lens, qsl, head_dim**-0.5)
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_with_cached_prefix_matches_reference(kv, head_dim, block_size, group):
    # Full prefill of 1 token and of an exact block multiple, a prefix-cache hit
    # (2 cached blocks + 7 new tokens) and a chunk in the middle of a long prompt.
    seq_lens = [1, 2 * block_size, 2 * block_size + 7, 3 * block_size + 3]
    q_lens = [1, 2 * block_size, 7, 20]
    _run(kv, head_dim, block_size, group, seq_lens, q_lens)


@pytest.mark.parametrize("chunk", [1, 5, 16, 33])
def test_chunked_prefill_chunk_sizes(kv, chunk):
    _run(kv, 64, 16, 2, [40 + chunk, chunk, 64], [chunk, chunk, 64])


def test_prefill_mixed_with_decode_and_empty_rows(kv):
    _run(kv, 64, 16, 4, [50, 1, 17, 33], [1, 1, 0, 33], block_m=32, block_n=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half_precision(kv, dtype):
    _run(kv, 128, 16, 2, [70, 20], [30, 20], dtype=dtype, block_m=32, block_n=64)
