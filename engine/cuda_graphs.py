"""CUDA graphs of decode-only steps at bucketed batch sizes.

A decode step of an 8B model is about 1,400 kernel launches; eagerly, the host
needs longer to launch them than the GPU needs to run them (Triton's launcher
alone costs ~40 us a call). Capturing the step once per batch-size bucket and
replaying it costs one launch (the approach of vLLM and nano-vllm).

Replays read their inputs from static device buffers, filled before each replay:
``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens`` and
``block_tables`` of fixed width ``cdiv(max_model_len, block_size)``. A step of
``n`` sequences replays the smallest bucket ``>= n``; the rows past ``n`` are
padding: slot ``-1`` (nothing stored), length 1 reading block 0 (never
written by them), so they cannot disturb real sequences.
"""

from __future__ import annotations

import bisect

import torch

from engine.attention import AttentionBackend, AttentionMetadata

# Powers of two, with midpoints above 16, so a step pays for at most ~1.5x its rows.
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
            640, 768, 896, 1024)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets up to ``max_num_seqs``, which is always the last one."""
    sizes = [b for b in _BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeCUDAGraphs:
    """Captured decode steps and the static buffers they read.

    Args:
        model: a callable ``model(input_ids, positions, kv_caches, meta, backend)``
            returning ``(T, hidden)``.
        kv_caches: per layer ``(k_cache, v_cache)``, each
            ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        backend: attention backend; must not sync the host (the Triton one does not).
        max_num_seqs: the largest batch captured.
        max_blocks_per_seq: block table width, ``cdiv(max_model_len, block_size)``.
        block_size: tokens per block.
        hidden_size, dtype, device: of the model's output.
    """

    def __init__(self, model, kv_caches, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        n, w = max_num_seqs, max_blocks_per_seq
        self.width = w
        # Static inputs, in their harmless padding state. They are views of two
        # buffers so a step's inputs arrive in two host-to-device copies and no
        # copy kernels: ``token_buf`` (3, B) int64 = input_ids | positions |
        # slot_mapping, and ``seq_buf`` (B + B * W,) int32 = seq_lens | block_tables
        # (the first ``B + bs * W`` entries hold everything bucket ``bs`` reads).
        self.token_buf = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.token_buf[2].fill_(-1)
        self.seq_buf = torch.zeros(n + n * w, dtype=torch.int32, device=device)
        self.seq_buf[:n].fill_(1)
        self.input_ids = self.token_buf[0]  # (B,)
        self.positions = self.token_buf[1]  # (B,)
        self.slot_mapping = self.token_buf[2]  # (B,)
        self.seq_lens = self.seq_buf[:n]  # (B,)
        self.block_tables = self.seq_buf[n:].view(n, w)  # (B, W)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # (B + 1,)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> (bucket, hidden) static output
        self.pool = None

    def bucket(self, num_seqs: int) -> int:
        """The smallest captured batch size ``>= num_seqs``."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def _meta(self, bs: int) -> AttentionMetadata:
        width = self.block_tables.shape[1]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=width * self.block_size, decode_only=True,
        )

    def _run(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs), self.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so that smaller ones reuse its memory pool."""
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-ups off the default stream, as capture wants
            for bs in reversed(self.batch_sizes):
                self._run(bs)  # compiles Triton kernels, creates cuBLAS handles
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._run(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def replay(self, bs: int) -> torch.Tensor:
        """Replay bucket ``bs`` on the static inputs; returns its ``(bs, hidden)`` output (a static buffer)."""
        self.graphs[bs].replay()
        return self.outputs[bs]
