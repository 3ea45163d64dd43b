"""Linear and embedding layers split across a tensor-parallel group.

The layout is Megatron-LM's (Shoeybi et al., 2019, section 3):

- ``MergedColumnParallelLinear``: ``y = x W^T + b`` with ``W``'s output rows
  split across ranks, so each rank computes its slice of ``y`` and no
  communication is needed. Several logical matrices that read the same input
  (q|k|v, gate|up) are stored as one, so one GEMM reads them all; rank ``r``
  holds the ``r``-th slice of each, concatenated.
- ``RowParallelLinear``: ``W``'s input columns split, so each rank multiplies its
  slice of ``x`` (the output of a column-parallel layer) and one all-reduce sums
  the partial products; the bias is added once, after the sum.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary split into
  contiguous ranges (padded to a multiple of the group size). A rank looks up
  the ids in its range and zeroes the rest, then an all-reduce; the head
  computes its range of logits and an all-gather joins them.

At world size 1 every layer is the plain one (no masking, no collectives). Each
layer loads full-size Hugging Face tensors through ``load``, taking its rank's
slice, so every rank reads the same checkpoint.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallelGroup


def _uniform_init(t: torch.Tensor, fan_in: int) -> None:
    """PyTorch's ``nn.Linear`` default: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` of the full layer's fan-in."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        t.uniform_(-bound, bound)


def check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"weights do not fit the model: {name} has shape {tuple(got)}, expected {tuple(want)}")


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel linears on the same input, fused into one GEMM.

    Args:
        in_features: input width (not split).
        output_sizes: full output width of each logical matrix, e.g.
            ``(H*D, H_kv*D, H_kv*D)`` for q|k|v; each must divide by the group size.
        bias: whether the layer has a bias.
        tp: the tensor-parallel group.
        names: the logical matrices' names, for error messages.

    Shapes:
        ``weight``: ``(sum(output_sizes) / world_size, in_features)``;
        forward ``(T, in_features) -> (T, sum(output_sizes) / world_size)``, the
        rank's slices in ``output_sizes`` order.

    Raises:
        ValueError: an output size not divisible by the group size.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TensorParallelGroup,
                 names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.names = list(names or [str(i) for i in range(len(output_sizes))])
        self.full_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(s, f"the output size of {n}") for s, n in zip(output_sizes, self.names)]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        self.in_features = in_features
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        _uniform_init(self.weight, in_features)
        if self.bias is not None:
            _uniform_init(self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, attr: str, full: torch.Tensor, shard: int) -> None:
        """Copy this rank's rows of logical matrix ``shard`` (``full``: HF-sized ``weight`` or ``bias``)."""
        size, local = self.full_sizes[shard], self.local_sizes[shard]
        want = (size, self.in_features) if attr == "weight" else (size,)
        check_shape(f"{self.names[shard]}.{attr}", full.shape, want)
        start = self.tp.rank * local
        getattr(self, attr).data[self.offsets[shard] : self.offsets[shard] + local].copy_(full[start : start + local])


class RowParallelLinear(nn.Module):
    """A linear whose input features are split across ranks; the output is all-reduced.

    Args:
        in_features: full input width; must divide by the group size.
        out_features: output width (not split).
        bias: added once, after the all-reduce.
        tp: the tensor-parallel group.

    Shapes:
        ``weight``: ``(out_features, in_features / world_size)``; forward
        ``(T, in_features / world_size) -> (T, out_features)``, equal on all ranks.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup,
                 name: str = "row-parallel linear") -> None:
        super().__init__()
        self.tp = tp
        self.name = name
        self.in_features, self.out_features = in_features, out_features
        self.local_in = tp.shard(in_features, f"the input size of {name}")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _uniform_init(self.weight, in_features)
        if self.bias is not None:
            _uniform_init(self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load(self, attr: str, full: torch.Tensor, shard: int = 0) -> None:
        if attr == "bias":
            check_shape(f"{self.name}.bias", full.shape, (self.out_features,))
            self.bias.data.copy_(full)
            return
        check_shape(f"{self.name}.weight", full.shape, (self.out_features, self.in_features))
        start = self.tp.rank * self.local_in
        self.weight.data.copy_(full[:, start : start + self.local_in])


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into contiguous per-rank ranges.

    Args:
        vocab_size: real vocabulary size; padded up to a multiple of the group size.
        hidden_size: embedding width.
        tp: the tensor-parallel group.

    Shapes:
        ``weight``: ``(padded_vocab / world_size, hidden_size)``, rank ``r`` holding ids
        ``[r * local, (r + 1) * local)`` (padding rows zero); forward
        ``(T,) int64 -> (T, hidden_size)``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup, name: str = "embedding") -> None:
        super().__init__()
        self.tp = tp
        self.name = name
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.local_vocab = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size))
        with torch.no_grad():
            self.weight.normal_()  # nn.Embedding's default
            self.weight[max(0, vocab_size - self.vocab_start) :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def load(self, attr: str, full: torch.Tensor, shard: int = 0) -> None:
        check_shape(f"{self.name}.weight", full.shape, (self.vocab_size, self.hidden_size))
        rows = full[self.vocab_start : self.vocab_start + self.local_vocab]
        self.weight.data.zero_()
        self.weight.data[: rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary range like the embedding (and tied to it when the model ties).

    ``compute_logits``: ``(N, hidden_size) -> (N, vocab_size)`` float32, the same on every rank.
    """

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        if self.tp.world_size == 1:
            return local.float()
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size].float()
