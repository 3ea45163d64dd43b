"""Batched block copies for KV swap out / swap in and for copy-on-write.

Choice (documented in :func:`copy_blocks`, measured in BENCHMARKS.md): inside one
GPU a single Triton launch copies every block. For swap out whose CPU block ids
form a few runs of consecutive ids, the GPU side is gathered with one
``index_select`` in HBM and each run crosses PCIe as one ``non_blocking`` DMA on
the copy engines (no SM time). Otherwise (scattered CPU ids; and swap in, where
it measured faster) with a pinned CPU pool the same Triton kernel reads or
writes the pinned pages directly
(zero-copy through unified addressing): one launch at about the pinned-copy
bandwidth, where one DMA per block, as in vLLM's ``swap_blocks``, pays a few
microseconds for every 32 KiB block (5% of the bandwidth on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr,  # (num_blocks_*, block_numel) flat views
    mapping_ptr,  # (num_pairs, 2) int64
    BLOCK_NUMEL: tl.constexpr, BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src_block = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(src_ptr + src_block * BLOCK_NUMEL + offs, mask=mask)
    tl.store(dst_ptr + dst_block * BLOCK_NUMEL + offs, x, mask=mask)


def copy_blocks_same_device(src: torch.Tensor, dst: torch.Tensor,
                            block_mapping: torch.Tensor) -> None:
    """One Triton launch copying ``src[m[0]] -> dst[m[1]]`` for every pair.

    Both tensors on one device (a GPU, or the CPU under ``TRITON_INTERPRET=1``);
    ``block_mapping`` ``(num_pairs, 2)`` int64 on that device. Shapes are checked
    by :func:`copy_blocks`.
    """
    num_pairs = block_mapping.shape[0]
    block_numel = src[0].numel()
    block = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_pairs, triton.cdiv(block_numel, block))
    _copy_blocks_kernel[grid](src, dst, block_mapping.contiguous(),
                              BLOCK_NUMEL=block_numel, BLOCK=block, num_warps=4)


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first_id, offset, length)`` of each run of consecutive ids (``ids`` sorted)."""
    ids_list = ids.tolist()
    runs, start = [], 0
    for i in range(1, len(ids_list) + 1):
        if i == len(ids_list) or ids_list[i] != ids_list[i - 1] + 1:
            runs.append((ids_list[start], start, i - start))
            start = i
    return runs


# More DMA runs than this and one zero-copy launch wins (each DMA costs ~10 us).
_MAX_DMA_RUNS = 8
# Swap in: zero-copy measured 89% of the pinned copy against 65-68% for the
# DMA + index_copy_ path even with one run (BENCHMARKS.md).
_ZERO_COPY_SWAP_IN = True


def _swap(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, cpu_col: int) -> None:
    """GPU <-> CPU copy; ``cpu_col`` is the mapping column of the CPU side (0: in, 1: out)."""
    cpu, gpu = (src, dst) if cpu_col == 0 else (dst, src)
    order = torch.argsort(mapping[:, cpu_col])
    src_ids, dst_ids = mapping[order, 0], mapping[order, 1]  # sorted by CPU block
    runs = _runs(mapping[order, cpu_col])
    zero_copy_in = cpu_col == 0 and _ZERO_COPY_SWAP_IN
    if cpu.is_pinned() and (zero_copy_in or len(runs) > _MAX_DMA_RUNS):
        copy_blocks_same_device(src, dst, mapping.to(gpu.device))  # zero-copy
    elif cpu_col == 1:  # swap out: gather in HBM, then one DMA per run
        staging = src.index_select(0, src_ids.to(gpu.device))  # (n, BS, H_kv, D)
        for first, offset, length in runs:
            dst[first:first + length].copy_(staging[offset:offset + length], non_blocking=True)
    else:  # swap in: one DMA per run, then scatter in HBM
        staging = torch.empty((len(src_ids), *src.shape[1:]), dtype=dst.dtype, device=gpu.device)
        for first, offset, length in runs:
            staging[offset:offset + length].copy_(src[first:first + length], non_blocking=True)
        dst.index_copy_(0, dst_ids.to(gpu.device), staging)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks ``src[m[0]] -> dst[m[1]]`` for each row of the mapping.

    Same semantics as :func:`kernels.reference.copy_blocks_ref`; used for swap out
    (GPU pool -> pinned CPU pool), swap in (back) and GPU-to-GPU block copies.

    * GPU -> same GPU: one Triton launch (:func:`copy_blocks_same_device`).
    * GPU -> CPU (swap out), CPU ids in at most 8 runs of consecutive ids: gather
      the blocks into a GPU staging tensor with one ``index_select``, then one
      ``non_blocking`` DMA per run straight into ``dst`` (copy engines, no SMs).
    * Swap out with scattered CPU ids, and every swap in, with a pinned CPU pool:
      one Triton launch that reads/writes the pinned pages directly (zero-copy;
      it occupies SMs while PCIe transfers, which the DMA path does not).
    * Unpinned CPU pool: one (in effect synchronous) copy per run of consecutive
      CPU ids through a GPU staging tensor and ``index_select``/``index_copy_``.
    * CPU -> CPU: plain indexing.

    All GPU work is queued on the current stream and nothing waits for it: the
    caller synchronises (an event) before reading a swapped-out block on the
    host. The CPU pool should be pinned, or the DMA is synchronous and slower.

    Args:
        src, dst: ``(num_blocks_*, block_size, num_kv_heads, head_dim)``, same
            dtype and block shape, contiguous; may live on different devices.
        block_mapping: ``(num_pairs, 2)`` int64 ``(src_block, dst_block)``;
            keep it on the CPU for cross-device copies (its ids are read on the
            host to find runs); destination ids must be distinct.

    Raises:
        ValueError: on mismatched dtype or block shape, or a malformed mapping.
    """
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src {src.dtype}{tuple(src.shape)} and dst {dst.dtype}"
                         f"{tuple(dst.shape)} differ in dtype or block shape")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be (num_pairs, 2), got {tuple(block_mapping.shape)}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if block_mapping.shape[0] == 0:
        return
    if src.device == dst.device:
        if src.is_cuda:
            copy_blocks_same_device(src, dst, block_mapping.to(src.device, torch.int64))
        else:
            dst[block_mapping[:, 1].long()] = src[block_mapping[:, 0].long()]
    elif src.is_cuda and dst.device.type == "cpu":
        _swap(src, dst, block_mapping.cpu().long(), cpu_col=1)
    elif src.device.type == "cpu" and dst.is_cuda:
        _swap(src, dst, block_mapping.cpu().long(), cpu_col=0)
    else:  # two GPUs: let the driver route it
        dst[block_mapping[:, 1].to(dst.device).long()] = \
            src[block_mapping[:, 0].to(src.device).long()].to(dst.device)
