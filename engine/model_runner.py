"""Turns a scheduler plan into tensors, runs the model, and returns logits.

For each scheduled request it takes the tokens ``[num_computed, num_computed + n)``
and builds ``input_ids``, ``positions``, ``slot_mapping`` (each token's cache
slot), the padded ``block_tables`` and ``seq_lens``, and ``logits_indices`` (the
last token of every request that samples this step).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledRequest


def _copy_blocks_fn(device: torch.device):
    if device.type == "cuda":
        from kernels.copy_blocks import copy_blocks

        return copy_blocks
    from kernels.reference import copy_blocks_ref

    return copy_blocks_ref


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


class ModelRunner:
    """Owns the model weights on the device and the paged KV cache tensors.

    Args:
        model: the loaded model, already on ``device`` in its dtype.
        num_blocks, block_size: KV pool geometry.
        device: where tensors live.
        backend: attention backend.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        backend: AttentionBackend,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.device = device
        self.backend = backend
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        # One (k, v) pair per layer, each (num_blocks, block_size, H_kv, D).
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.config.num_hidden_layers)
        ]
        # The swap pool, pinned when the device is a GPU so copies run on the DMA engines.
        # Uninitialised on purpose: a CPU block is only ever read after a swap-out
        # wrote all of it, and untouched pages cost no memory on the CPU.
        pin = device.type == "cuda"
        self.cpu_kv_caches = [
            (torch.empty((num_cpu_blocks, *shape[1:]), dtype=dtype, pin_memory=pin),
             torch.empty((num_cpu_blocks, *shape[1:]), dtype=dtype, pin_memory=pin))
            for _ in range(self.config.num_hidden_layers)
        ]
        self._copy_blocks = _copy_blocks_fn(device)

    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Copy blocks GPU -> CPU pool, then CPU pool -> GPU; one batched copy per layer and direction."""
        for mapping, out in ((blocks_to_swap_out, True), (blocks_to_swap_in, False)):
            if not mapping:
                continue
            m = torch.tensor(mapping, dtype=torch.int64)
            for (gk, gv), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                if out:
                    self._copy_blocks(gk, ck, m)
                    self._copy_blocks(gv, cv, m)
                else:
                    self._copy_blocks(ck, gk, m)
                    self._copy_blocks(cv, gv, m)

    def prepare(self, plans: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build the step's inputs.

        Returns:
            ``input_ids`` (T,) int64, ``positions`` (T,) int64, the attention
            metadata, and ``logits_indices`` (num_sampling,) int64 into T.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for plan in plans:
            r = plan.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + plan.num_new_tokens
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            table = r.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + plan.num_new_tokens)
            seq_lens.append(end)
            if plan.samples:
                logits_indices.append(query_start_loc[-1] - 1)
        max_blocks = max(len(p.request.block_table) for p in plans)
        block_tables = torch.zeros((len(plans), max_blocks), dtype=torch.int32)
        for i, plan in enumerate(plans):
            table = plan.request.block_table
            block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        max_query_len = max(p.num_new_tokens for p in plans)
        meta = AttentionMetadata(
            slot_mapping=dev(slot_mapping, torch.int64),
            query_start_loc=dev(query_start_loc, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_tables=block_tables.to(self.device, non_blocking=True),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            decode_only=max_query_len == 1,
        )
        return dev(input_ids, torch.int64), dev(positions, torch.int64), meta, dev(logits_indices, torch.int64)

    @torch.inference_mode()
    def execute(self, plans: list[ScheduledRequest]) -> torch.Tensor:
        """Run one step.

        Returns:
            ``(num_sampling, vocab)`` float32 logits, one row per plan whose
            ``samples`` is true, in plan order.
        """
        input_ids, positions, meta, logits_indices = self.prepare(plans)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)  # (T, hidden)
        return self.model.compute_logits(hidden[logits_indices])
