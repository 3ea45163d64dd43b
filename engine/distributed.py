"""The tensor-parallel group this process belongs to (Megatron-LM style).

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism" (2019), section 3: each rank of a tensor-parallel group
holds a slice of every weight matrix; one all-reduce after the attention output
projection and one after the MLP down projection make the ranks' partial sums
whole again. vLLM keeps the same layout for inference.

One process per rank. The process that runs the scheduler is rank 0; it joins the
group itself and drives the other ranks (``engine.executor``). Collectives run on
``torch.distributed``: NCCL between GPUs, gloo between CPU processes (tests).

A process outside any group (the default) sees a group of size 1, whose
collectives are no-ops, so the model code is the same at every size.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in its tensor-parallel group.

    Attributes:
        rank: 0-based rank in the group.
        world_size: number of ranks (the tensor-parallel size).
    """

    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``. A no-op for one rank."""
        return _all_reduce(x) if self.world_size > 1 else x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        return torch.cat(_all_gather(x.contiguous(), self.world_size), dim=dim)

    def shard(self, size: int, what: str) -> int:
        """``size // world_size``.

        Raises:
            ValueError: ``size`` is not a multiple of the world size (``what`` names it).
        """
        if size % self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} does not divide {what} ({size})")
        return size // self.world_size


# Collectives stay outside torch.compile'd graphs (a graph break, as for the
# attention kernels); at one rank they are never called, so nothing breaks.
@torch.compiler.disable
def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


@torch.compiler.disable
def _all_gather(x: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return parts


_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    """The current process's group (size 1 unless ``init_tensor_parallel`` ran)."""
    return _GROUP


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the default process group as ``rank`` of ``world_size`` and make it current.

    Args:
        init_method: rendezvous address, e.g. ``tcp://127.0.0.1:29500``.
        backend: ``nccl`` (GPUs) or ``gloo`` (CPUs).
        timeout_s: how long a collective may wait for a peer before it fails.

    Raises:
        RuntimeError: this process is already in a group, or the rendezvous failed.
    """
    global _GROUP
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group; "
                           "one tensor-parallel engine per process")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _GROUP = TensorParallelGroup(rank, world_size)
    return _GROUP


def destroy_tensor_parallel() -> None:
    """Leave the group (if any); the process is back to a group of size 1."""
    global _GROUP
    _GROUP = TensorParallelGroup()
    if dist.is_initialized():
        dist.destroy_process_group()
