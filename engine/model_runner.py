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

import math
from dataclasses import dataclass

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


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes one block takes on one rank across all layers, K and V (each rank holds ``H_kv / N`` heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = config.num_key_value_heads // tensor_parallel_size
    return 2 * config.num_hidden_layers * block_size * heads * config.head_dim * elem


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
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()  # re-recording moves the event to this step's copies

    def host(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` (a view of a buffer that grows by doubling)."""
        n = math.prod(shape)
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


def _fill_block_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """Row ``i`` of ``out`` (int32, wide enough) is ``tables[i]``, padded with 0."""
    out.fill(0)  # the reference backends gather whole rows; block 0 is always a valid id
    for i, table in enumerate(tables):
        out[i, : len(table)] = table


@dataclass
class StepInput:
    """One step's inputs as host lists: built by rank 0, sent to the other ranks.

    Attributes:
        input_ids, positions, slot_mapping: per new token (T entries each).
        query_start_loc: ``num_seqs + 1`` cumulative new-token counts.
        seq_lens: per sequence, context length after this step.
        logits_indices: indices into T of the tokens whose logits are sampled.
        block_tables: per sequence, its block ids.
        max_query_len: the most new tokens of one sequence (1: a decode-only step).
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    logits_indices: list[int]
    block_tables: list[list[int]]
    max_query_len: int


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
        shape = (num_blocks, block_size, model.num_local_kv_heads, self.config.head_dim)
        # One (k, v) pair per layer, each (num_blocks, block_size, H_kv, D); under tensor
        # parallelism H_kv is this rank's share of the KV heads.
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
        self._graph_host: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned mirrors of the graph inputs
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

    def build_step_input(self, plans: list[ScheduledRequest]) -> StepInput:
        """Flatten a plan into host lists (what every tensor-parallel rank needs to run the step)."""
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
        return StepInput(input_ids, positions, slot_mapping, query_start_loc, seq_lens, logits_indices,
                         [p.request.block_table for p in plans], max(p.num_new_tokens for p in plans))

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build the step's device inputs (the eager path).

        Returns:
            ``input_ids`` (T,) int64, ``positions`` (T,) int64, the attention
            metadata, and ``logits_indices`` (num_sampling,) int64 into T.
        """
        st = self.staging
        st.begin()
        max_blocks = max(len(t) for t in step.block_tables)
        bt_host = st.host("block_tables", (len(step.block_tables), max_blocks), torch.int32)
        _fill_block_tables(bt_host.numpy(), step.block_tables)
        meta = AttentionMetadata(
            slot_mapping=st.to_device("slot_mapping", step.slot_mapping, torch.int64),
            query_start_loc=st.to_device("query_start_loc", step.query_start_loc, torch.int32),
            seq_lens=st.to_device("seq_lens", step.seq_lens, torch.int32),
            block_tables=bt_host.to(self.device, non_blocking=True),
            max_query_len=step.max_query_len,
            max_seq_len=max(step.seq_lens),
            decode_only=step.max_query_len == 1,
        )
        out = (st.to_device("input_ids", step.input_ids, torch.int64),
               st.to_device("positions", step.positions, torch.int64),
               meta, st.to_device("logits_indices", step.logits_indices, torch.int64))
        st.end()
        return out

    def _graph_step(self, step: StepInput) -> torch.Tensor:
        """Fill the graphs' static inputs (padding rows included) and replay; returns ``(B, hidden)``.

        Pinned host mirrors of the graphs' ``token_buf`` and ``seq_buf`` layouts
        (allocated once) are filled in place, so two non-blocking copies move
        everything (``DecodeCUDAGraphs``). This is on the critical path of every
        decode step: the GPU idles from the previous step's sample until the replay.
        """
        g = self.graphs
        n = len(step.seq_lens)
        bs = g.bucket(n)
        big, w = g.max_num_seqs, g.width
        if self._graph_host is None:
            self._graph_host = (torch.empty((3, big), dtype=torch.int64, pin_memory=self.staging.pin),
                                torch.empty(big + big * w, dtype=torch.int32, pin_memory=self.staging.pin))
            self._graph_host_np = tuple(h.numpy() for h in self._graph_host)
        tok, seq = self._graph_host
        t, s = self._graph_host_np
        self.staging.begin()  # last step's copies out of these buffers are done
        t[0, :n], t[1, :n], t[2, :n] = step.input_ids, step.positions, step.slot_mapping
        t[0, n:bs], t[1, n:bs], t[2, n:bs] = 0, 0, -1
        used = big + bs * w
        s[:n] = step.seq_lens
        s[n:bs] = 1
        _fill_block_tables(s[big:used].reshape(bs, w), step.block_tables)
        g.token_buf.copy_(tok, non_blocking=True)
        g.seq_buf[:used].copy_(seq[:used], non_blocking=True)
        self.staging.end()
        return g.replay(bs)

    def execute(self, plans: list[ScheduledRequest]) -> torch.Tensor:
        """Run one step of ``plans`` (non-empty); see ``execute_step``."""
        return self.execute_step(self.build_step_input(plans))

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> torch.Tensor:
        """Run one step.

        Returns:
            ``(num_sampling, vocab)`` float32 logits, one row per sequence that
            samples this step, in plan order.
        """
        n = len(step.seq_lens)
        if self.graphs is not None and step.max_query_len == 1 and n <= self.graphs.max_num_seqs:
            hidden = self._graph_step(step)  # (B, hidden), B >= n
            if step.logits_indices == list(range(n)):
                return self.model.compute_logits(hidden[:n])
            index = torch.tensor(step.logits_indices, dtype=torch.int64).to(self.device, non_blocking=True)
            return self.model.compute_logits(hidden[index])
        input_ids, positions, meta, logits_indices = self.prepare(step)
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
    # All layers of every engine in the process share one code object, hence one
    # cache of compiled graphs; each model shape adds entries (dynamo's default
    # limit of 8 is reached by a handful of small test models, after which layers
    # silently run eagerly through a guard check).
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 256))
    for layer in model.model.layers:
        layer.compile(dynamic=True)


def build_runner(model: LlamaForCausalLM, device: torch.device, attention_backend: str, compile_model: bool,
                 num_blocks: int, block_size: int, num_cpu_blocks: int, *, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool) -> ModelRunner:
    """The attention backend by name, ``compile_layers`` if asked, then the ``ModelRunner``
    (which allocates the KV cache and captures CUDA graphs); the same on every rank."""
    from engine.attention import make_attention_backend

    backend = make_attention_backend(attention_backend, device)
    if compile_model:
        compile_layers(model, backend)
    return ModelRunner(model, num_blocks, block_size, device, backend, num_cpu_blocks,
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len, cuda_graphs=cuda_graphs)
