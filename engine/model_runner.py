"""Turns a scheduler plan into tensors, runs the model, and returns logits.

For each scheduled request it takes the tokens ``[num_computed, num_computed + n)``
and builds ``input_ids``, ``positions``, ``slot_mapping`` (each token's cache
slot), the padded ``block_tables`` and ``seq_lens``, and ``logits_indices`` (the
last token of every request that samples this step).

On the GPU the inputs are written into pinned host buffers and copied with
``non_blocking=True`` (no pageable staging, no host sync), and decode-only steps
replay CUDA graphs (``engine.cuda_graphs``); prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeCUDAGraphs
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledRequest


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first_id, offset, length)`` of each run of consecutive ids, in the list's order."""
    runs: list[tuple[int, int, int]] = []
    for offset, block_id in enumerate(ids):
        if runs and block_id == runs[-1][0] + runs[-1][2] and offset == runs[-1][1] + runs[-1][2]:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((block_id, offset, 1))
    return runs


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


class _Staging:
    """Host buffers for one step's inputs, pinned on the GPU path, reused every step.

    A buffer is rewritten only after the copies that read it last step have
    finished (an event is recorded after them), so ``non_blocking`` stays safe
    even when no sync happened in between.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None

    def begin(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def end(self) -> None:
        if self.pin:
            self._done = torch.cuda.Event()
            self._done.record()

    def host(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` (a view of a buffer that grows by doubling)."""
        n = int(np.prod(shape))
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 64))
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pin)
            self._bufs[(name, dtype)] = buf
        return buf[:n].view(shape)

    def to_device(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """Copy a flat list of ints to the device through the ``name`` buffer."""
        host = self.host(name, (len(values),), dtype)
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)


def _fill_block_tables(out: np.ndarray, plans: list[ScheduledRequest]) -> None:
    """Row ``i`` of ``out`` (int32, wide enough) is plan ``i``'s block table, padded with 0."""
    out.fill(0)  # the reference backends gather whole rows; block 0 is always a valid id
    for i, plan in enumerate(plans):
        table = plan.request.block_table
        out[i, : len(table)] = table


class ModelRunner:
    """Owns the model weights on the device and the paged KV cache tensors.

    Args:
        model: the loaded model, already on ``device`` in its dtype.
        num_blocks, block_size: KV pool geometry.
        device: where tensors live.
        backend: attention backend.
        num_cpu_blocks: swap pool size in blocks.
        max_num_seqs: the most sequences in one step (the largest CUDA graph).
        max_model_len: longest sequence, tokens (sets the graphs' block table width).
        cuda_graphs: replay CUDA graphs for decode-only steps (CUDA devices only).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        backend: AttentionBackend,
        num_cpu_blocks: int = 0,
        *,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        cuda_graphs: bool = False,
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
        # The swap pool, block-major across layers: (num_cpu_blocks, layers, 2, block_size,
        # H_kv, D), so a run of consecutive CPU blocks is one contiguous region and a
        # step's swap crosses PCIe as one DMA per run, whatever the layer count. Pinned
        # when the device is a GPU so copies run on the DMA engines. Uninitialised on
        # purpose: a CPU block is only ever read after a swap-out wrote all of it.
        pin = device.type == "cuda"
        self.cpu_kv_pool = torch.empty(
            (num_cpu_blocks, self.config.num_hidden_layers, 2, *shape[1:]), dtype=dtype, pin_memory=pin
        )
        self.staging = _Staging(device)
        max_model_len = max_model_len or self.config.max_position_embeddings
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.graphs: DecodeCUDAGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeCUDAGraphs(model, self.kv_caches, backend, max_num_seqs,
                                           self.max_blocks_per_seq, block_size, device)
            self.graphs.capture()

    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Copy blocks GPU -> CPU pool, then CPU pool -> GPU.

        Swap out gathers every layer's K and V of the moving blocks into one
        device staging tensor ``(n, layers, 2, block_size, H_kv, D)`` and moves it
        with one copy per run of consecutive CPU block ids; swap in is the mirror
        image. All copies are ordered on the current stream, so the freed GPU
        blocks are not overwritten before their bytes have left.
        """
        if blocks_to_swap_out:
            gpu_ids = torch.tensor([g for g, _ in blocks_to_swap_out], device=self.device)
            staging = torch.empty((len(blocks_to_swap_out), *self.cpu_kv_pool.shape[1:]),
                                  dtype=self.cpu_kv_pool.dtype, device=self.device)
            for layer, (k, v) in enumerate(self.kv_caches):
                torch.index_select(k, 0, gpu_ids, out=staging[:, layer, 0])
                torch.index_select(v, 0, gpu_ids, out=staging[:, layer, 1])
            for first, offset, length in _runs([c for _, c in blocks_to_swap_out]):
                self.cpu_kv_pool[first : first + length].copy_(staging[offset : offset + length], non_blocking=True)
        if blocks_to_swap_in:
            gpu_ids = torch.tensor([g for _, g in blocks_to_swap_in], device=self.device)
            staging = torch.empty((len(blocks_to_swap_in), *self.cpu_kv_pool.shape[1:]),
                                  dtype=self.cpu_kv_pool.dtype, device=self.device)
            for first, offset, length in _runs([c for c, _ in blocks_to_swap_in]):
                staging[offset : offset + length].copy_(self.cpu_kv_pool[first : first + length], non_blocking=True)
            for layer, (k, v) in enumerate(self.kv_caches):
                k.index_copy_(0, gpu_ids, staging[:, layer, 0])
                v.index_copy_(0, gpu_ids, staging[:, layer, 1])

    @staticmethod
    def _flatten(plans: list[ScheduledRequest], bs: int):
        """Python lists of the step's per-token and per-sequence values."""
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
        return input_ids, positions, slot_mapping, query_start_loc, seq_lens, logits_indices

    def prepare(self, plans: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build the step's inputs (the eager path).

        Returns:
            ``input_ids`` (T,) int64, ``positions`` (T,) int64, the attention
            metadata, and ``logits_indices`` (num_sampling,) int64 into T.
        """
        st = self.staging
        st.begin()
        ids, positions, slots, qsl, seq_lens, logits_indices = self._flatten(plans, self.block_size)
        max_blocks = max(len(p.request.block_table) for p in plans)
        bt_host = st.host("block_tables", (len(plans), max_blocks), torch.int32)
        _fill_block_tables(bt_host.numpy(), plans)
        max_query_len = max(p.num_new_tokens for p in plans)
        meta = AttentionMetadata(
            slot_mapping=st.to_device("slot_mapping", slots, torch.int64),
            query_start_loc=st.to_device("query_start_loc", qsl, torch.int32),
            seq_lens=st.to_device("seq_lens", seq_lens, torch.int32),
            block_tables=bt_host.to(self.device, non_blocking=True),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            decode_only=max_query_len == 1,
        )
        out = (st.to_device("input_ids", ids, torch.int64), st.to_device("positions", positions, torch.int64),
               meta, st.to_device("logits_indices", logits_indices, torch.int64))
        st.end()
        return out

    def _graph_step(self, plans: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """Fill the graphs' static inputs (padding rows included) and replay; returns ``(B, hidden)``."""
        g, st = self.graphs, self.staging
        n = len(plans)
        bs = g.bucket(n)
        st.begin()
        ids, positions, slots, _, seq_lens, logits_indices = self._flatten(plans, self.block_size)
        # One int64 buffer (ids, positions, slots) and one int32 (seq_lens, then the block tables).
        tok = st.host("graph_tokens", (3, bs), torch.int64)
        t = tok.numpy()
        t[0, :n], t[1, :n], t[2, :n] = ids, positions, slots
        t[0, n:], t[1, n:], t[2, n:] = 0, 0, -1
        width = g.block_tables.shape[1]
        seq = st.host("graph_seq", (bs, 1 + width), torch.int32)
        s = seq.numpy()
        s[:n, 0] = seq_lens
        s[n:, 0] = 1
        _fill_block_tables(s[:, 1:], plans)
        tok_dev = tok.to(self.device, non_blocking=True)
        seq_dev = seq.to(self.device, non_blocking=True)
        st.end()
        g.input_ids[:bs].copy_(tok_dev[0])
        g.positions[:bs].copy_(tok_dev[1])
        g.slot_mapping[:bs].copy_(tok_dev[2])
        g.seq_lens[:bs].copy_(seq_dev[:, 0])
        g.block_tables[:bs].copy_(seq_dev[:, 1:])
        return g.replay(bs), logits_indices

    @torch.inference_mode()
    def execute(self, plans: list[ScheduledRequest]) -> torch.Tensor:
        """Run one step.

        Returns:
            ``(num_sampling, vocab)`` float32 logits, one row per plan whose
            ``samples`` is true, in plan order.
        """
        decode_only = all(p.num_new_tokens == 1 for p in plans)
        if self.graphs is not None and decode_only and len(plans) <= self.graphs.max_num_seqs:
            hidden, logits_indices = self._graph_step(plans)  # (B, hidden), B >= len(plans)
            if logits_indices == list(range(len(plans))):
                return self.model.compute_logits(hidden[: len(plans)])
            index = torch.tensor(logits_indices, dtype=torch.int64).to(self.device, non_blocking=True)
            return self.model.compute_logits(hidden[index])
        input_ids, positions, meta, logits_indices = self.prepare(plans)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)  # (T, hidden)
        return self.model.compute_logits(hidden[logits_indices])


def compile_layers(model: LlamaForCausalLM, backend: AttentionBackend) -> None:
    """``torch.compile`` every decoder layer in place (regional compilation).

    The layers share one compiled graph (same code, parameters as inputs); the
    attention backend is left out of it (a graph break), so its Triton kernels
    run as they are. Inductor fuses the norms, rotary embedding and SwiGLU
    elementwise work that otherwise costs ~30 small kernels a layer.
    """
    backend.forward = torch.compiler.disable(backend.forward)
    for layer in model.model.layers:
        layer.compile(dynamic=True)
