"""Helpers for the kernel tests: device, random paged caches, error measure."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class KV:
    """Random paged caches and block tables; every draw is fresh (seed reported)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(device=DEVICE, dtype=dtype)

    def caches(self, num_blocks, block_size, num_kv_heads, head_dim, dtype):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return self.randn(*shape, dtype=dtype), self.randn(*shape, dtype=dtype)

    def block_tables(self, seq_lens, block_size, num_blocks, extra_cols=1):
        """``(num_seqs, max_blocks)`` int32: distinct random blocks, ``-1`` padding."""
        need = [(n + block_size - 1) // block_size for n in seq_lens]
        perm = torch.randperm(num_blocks, generator=self.gen)
        assert sum(need) <= num_blocks
        table = torch.full((len(seq_lens), max(need) + extra_cols), -1, dtype=torch.int32)
        used = 0
        for i, n in enumerate(need):
            table[i, :n] = perm[used:used + n].to(torch.int32)
            used += n
        return table.to(DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (unwritten or bad masking)"
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    # fp32 through the interpreter is exact fp32; on the GPU fp32 dots use ieee.
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
