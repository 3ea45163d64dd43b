"""The GPU path's logic, run on the CPU: dummy models, graph-step staging and padding, compile.

CUDA graphs themselves need a GPU (benchmarks/bench_gpu_engine.py checks them
there); here the graph runner replays by running the model eagerly on its static
buffers, which exercises everything but the capture: bucketing, padded rows
(slot -1, length 1), the fixed-width block tables and the staging buffers.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.cuda_graphs import DecodeCUDAGraphs, graph_batch_sizes
from engine.dummy_models import DUMMY_CONFIGS, build_dummy_model, weight_bytes
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import ModelRunner, compile_layers
from engine.sampling_params import SamplingParams

TINY = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                   attention_bias=True, tie_word_embeddings=True)


class EagerReplayGraphs(DecodeCUDAGraphs):
    """A CPU stand-in: 'replay' runs the model on the static buffers."""

    def capture(self) -> None:
        self.replays = []

    def replay(self, bs: int) -> torch.Tensor:
        self.replays.append(bs)
        with torch.inference_mode():
            return self._run(bs)


def _engine(backend: str, graphs: bool, **kw) -> LLMEngine:
    engine = LLMEngine(TINY, None, None, EngineConfig(num_gpu_blocks=64, block_size=16, max_num_seqs=8,
                                                       attention_backend=backend, seed=3, **kw))
    if graphs:
        r = engine.runner
        r.graphs = EagerReplayGraphs(r.model, r.kv_caches, r.backend, 8, r.max_blocks_per_seq, r.block_size,
                                     r.device)
        r.graphs.capture()
    return engine


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


PROMPTS = [[5, 9, 2, 7, 1], list(range(3, 40)), [11] * 16]  # 16: an exact block


def test_graph_buckets_end_at_max_num_seqs():
    assert graph_batch_sizes(256)[:5] == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(300)[-2:] == [256, 300]


def test_dummy_configs_have_real_shapes():
    c = DUMMY_CONFIGS["llama-3-8b"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (4096, 32, 8, 128)
    assert DUMMY_CONFIGS["qwen2.5-0.5b"].attention_bias and DUMMY_CONFIGS["qwen2.5-0.5b"].head_dim == 64
    assert DUMMY_CONFIGS["smollm2-135m"].head_dim == 64


def test_dummy_model_is_built_in_dtype_with_random_biases():
    model = build_dummy_model(TINY, "cpu", torch.bfloat16, seed=1)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope.cos.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    n = sum(p.numel() for p in model.parameters())
    assert weight_bytes(model) == 2 * n


def test_graph_replay_path_matches_eager_with_padded_rows():
    eager = _greedy(_engine("reference", graphs=False), PROMPTS, 12)
    engine = _engine("reference", graphs=True)
    replayed = _greedy(engine, PROMPTS, 12)
    assert replayed == eager
    assert 4 in engine.runner.graphs.replays  # 3 sequences padded to the bucket of 4


def test_graph_replay_path_with_triton_kernels():
    eager = _greedy(_engine("reference", graphs=False), PROMPTS[:2], 6)
    assert _greedy(_engine("triton", graphs=True), PROMPTS[:2], 6) == eager


def test_staging_reuses_host_buffers():
    engine = _engine("reference", graphs=False)
    _greedy(engine, PROMPTS[:1], 4)
    bufs = dict(engine.runner.staging._bufs)
    _greedy(engine, [PROMPTS[0][:3]], 4)
    assert all(engine.runner.staging._bufs[k] is v for k, v in bufs.items())


def test_compiled_layers_match_eager():
    eager = _greedy(_engine("reference", graphs=False), PROMPTS[:2], 5)
    engine = _engine("reference", graphs=False, compile_model=True)
    assert isinstance(engine.runner, ModelRunner)
    assert _greedy(engine, PROMPTS[:2], 5) == eager
