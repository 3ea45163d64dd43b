"""The attention interface between the model and the paged KV cache.

The model computes q/k/v for the step's new tokens and hands them to a backend,
which stores k/v into the cache (by ``slot_mapping``) and attends each new token
to its sequence's cached context (by ``block_tables``). Two backends share one
metadata object:

- ``ReferenceAttentionBackend``: plain PyTorch (``kernels.reference``), the spec;
- ``SdpaAttentionBackend``: gathers the paged context and calls PyTorch's fused
  ``scaled_dot_product_attention``, the fast CPU path;
- ``TritonAttentionBackend``: the Triton kernels in ``kernels/`` (GPU, and the CPU
  under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import reference


@dataclass
class AttentionMetadata:
    """Per-step layout of the batch, shared by every layer.

    Attributes:
        slot_mapping: ``(num_tokens,)`` int64 cache slot of each new token.
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative new-token counts.
        seq_lens: ``(num_seqs,)`` int32 context length after this step's tokens.
        block_tables: ``(num_seqs, max_blocks)`` int32, padded with 0.
        max_query_len: the longest run of new tokens of one sequence.
        max_seq_len: the longest context.
        decode_only: every sequence has exactly one new token.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    decode_only: bool


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store ``key``/``value`` into the caches, then attend.

        Args:
            query: ``(num_tokens, num_heads, head_dim)``.
            key, value: ``(num_tokens, num_kv_heads, head_dim)``.
            k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.

        Returns:
            ``(num_tokens, num_heads, head_dim)``.
        """


class ReferenceAttentionBackend:
    """Plain-PyTorch attention over the paged cache; exact fp32 math for parity tests."""

    name = "reference"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        reference.store_kvcache_ref(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            return reference.paged_decode_attention_ref(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
            )
        return reference.paged_attention_ref(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
        )


class SdpaAttentionBackend:
    """Paged attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Decode gathers every sequence's blocks into one padded ``(B, H_kv, L, D)``
    tensor and masks by length; prefill runs per sequence, attending to the new
    tokens directly when nothing is cached before them (no gather).
    """

    name = "sdpa"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        reference.store_kvcache_ref(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        qsl = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # (1, H, q_len, D)
            if end - start == seq_len:  # fresh prefill: the new tokens are the whole context
                k = key[start:end].transpose(0, 1).unsqueeze(0)  # (1, H_kv, L, D)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k = reference.gather_kv_ref(k_cache, meta.block_tables[i], seq_len).transpose(0, 1).unsqueeze(0)
                v = reference.gather_kv_ref(v_cache, meta.block_tables[i], seq_len).transpose(0, 1).unsqueeze(0)
                q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device).unsqueeze(1)
                mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos  # (q_len, L)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(query, k_cache, v_cache, meta, scale):
        num_seqs, _, head_dim = query.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        n_blocks = -(-meta.max_seq_len // block_size)
        bt = meta.block_tables[:, :n_blocks].long()
        # (B, H_kv, n_blocks * block_size, D)
        k = k_cache[bt].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache[bt].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=query.device)
        mask = positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1).long()  # (B, L)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )  # (B, H, 1, D)
        return out.squeeze(2)


class TritonAttentionBackend:
    """The Triton kernels of ``kernels/``: paged decode (split-K) and paged prefill."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.decode_attention import paged_decode_attention
        from kernels.prefill_attention import paged_prefill_attention
        from kernels.store_kv import store_kvcache

        self._store = store_kvcache
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        self._store(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return self._prefill(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
        )


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``"auto"`` picks Triton on CUDA and SDPA elsewhere.

    Raises:
        ValueError: unknown backend name.
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "sdpa"
    if name == "reference":
        return ReferenceAttentionBackend()
    if name == "sdpa":
        return SdpaAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, reference, sdpa or triton")
