"""copy_blocks against copy_blocks_ref: same device, and GPU <-> pinned CPU swaps."""

import pytest
import torch

from tests.kernels.helpers import DEVICE
from kernels.copy_blocks import copy_blocks, copy_blocks_same_device
from kernels.reference import copy_blocks_ref


def _pools(kv, n_src, n_dst, dtype=torch.float32, src_device=DEVICE, dst_device=DEVICE):
    src = kv.randn(n_src, 16, 2, 8, dtype=dtype).to(src_device)
    dst = torch.full((n_dst, 16, 2, 8), float("nan"), dtype=dtype, device=dst_device)
    if dst_device == "cpu" and torch.cuda.is_available():
        dst = dst.pin_memory()
    return src, dst


def _mapping(kv, n_src, n_dst, num_pairs):
    src_ids = torch.randperm(n_src, generator=kv.gen)[:num_pairs]
    dst_ids = torch.randperm(n_dst, generator=kv.gen)[:num_pairs]
    return torch.stack([src_ids, dst_ids], 1)  # (num_pairs, 2) int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_block_copy_matches_reference(kv, dtype):
    src, dst = _pools(kv, 10, 12, dtype)
    mapping = _mapping(kv, 10, 12, 7)
    ref = dst.clone()
    copy_blocks_ref(src, ref, mapping)
    copy_blocks_same_device(src, dst, mapping.to(DEVICE))
    torch.testing.assert_close(dst, ref, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_same_device_and_empty_mapping(kv):
    src, dst = _pools(kv, 6, 6)
    ref = dst.clone()
    copy_blocks(src, dst, torch.empty(0, 2, dtype=torch.int64))
    mapping = _mapping(kv, 6, 6, 4)
    copy_blocks(src, dst, mapping)
    copy_blocks_ref(src, ref, mapping)
    torch.testing.assert_close(dst, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="swap to pinned memory needs CUDA")
@pytest.mark.parametrize("direction", ["out", "in"])
@pytest.mark.parametrize("cpu_ids", ["one run (DMA)", "few runs (DMA)", "scattered (zero-copy)"])
def test_swap_between_gpu_and_pinned_cpu(kv, direction, cpu_ids):
    gpu_dev, cpu_dev = "cuda", "cpu"
    n_gpu, n_cpu, pairs = 20, 40, 18
    mapping = _mapping(kv, n_gpu, n_cpu, pairs)
    if cpu_ids == "one run (DMA)":
        mapping[:, 1] = torch.arange(4, 4 + pairs)
    elif cpu_ids == "few runs (DMA)":
        mapping[:, 1] = torch.cat([torch.arange(0, 9), torch.arange(20, 29)])
    else:  # every id its own run: more runs than the DMA path takes
        mapping[:, 1] = 2 * torch.randperm(n_cpu // 2, generator=kv.gen)[:pairs]
    if direction == "in":
        mapping = mapping.flip(1)
        src, dst = _pools(kv, n_cpu, n_gpu, torch.bfloat16, cpu_dev, gpu_dev)
        src = src.pin_memory()
    else:
        src, dst = _pools(kv, n_gpu, n_cpu, torch.bfloat16, gpu_dev, cpu_dev)
    ref = dst.clone()
    copy_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    copy_blocks_ref(src, ref, mapping)
    torch.testing.assert_close(dst, ref, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_rejects_other_block_shape(kv):
    with pytest.raises(ValueError):
        copy_blocks(kv.randn(2, 16, 2, 8), kv.randn(2, 32, 2, 8),
                    torch.zeros(1, 2, dtype=torch.int64))
