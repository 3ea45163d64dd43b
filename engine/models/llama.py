"""A Llama-family decoder whose attention reads and writes the paged KV cache.

Architecture as in Touvron et al., "LLaMA" (2023) and Hugging Face's
``LlamaForCausalLM``: RMSNorm, rotary position embeddings (Su et al., RoFormer)
in the rotate-half layout, grouped-query attention (Ainslie et al., 2023), a
SwiGLU MLP, tied or untied output embeddings. q/k/v and gate/up are fused into
one GEMM each (``qkv_proj``, ``gate_up_proj``); ``load_hf_state_dict`` takes a
Hugging Face state dict as it is. Every linear and the embeddings are
tensor-parallel layers (``engine.models.parallel_layers``), which are the plain
layers at a group size of 1.

Tokens of all sequences in a step are flattened into one dimension ``T``; the
attention backend uses ``AttentionMetadata`` to find each token's sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.distributed import TensorParallelGroup, get_tp_group
from engine.models.parallel_layers import (MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding, check_shape)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), computed in fp32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_positions)``, rotate-half layout."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions (T,); q (T, H, D); k (T, H_kv, D)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention; q|k|v in one column-parallel GEMM, o_proj row-parallel.

    With a tensor-parallel group of size ``N`` each rank owns ``H / N`` query heads
    and ``H_kv / N`` KV heads (whole GQA groups stay on one rank) and its own share
    of the paged KV cache.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.head_dim = d = config.head_dim
        self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(config.num_key_value_heads, "num_key_value_heads")
        h = config.hidden_size
        self.qkv_proj = MergedColumnParallelLinear(
            h, (config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d),
            config.attention_bias, tp, names=("q_proj", "k_proj", "v_proj"))
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, False, tp, name="o_proj")
        self.split = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.scale = d**-0.5

    def forward(self, positions, x, rope, kv_cache, meta, backend):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H_local, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, H_kv_local, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # (T, H_local, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU with gate|up in one column-parallel GEMM and a row-parallel down projection."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, (f, f), False, tp, names=("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(f, h, False, tp, name="down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(positions, self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, "embed_tokens")
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output head.

    Args:
        config: the model's shape.
        tp: the tensor-parallel group whose rank's shard this model holds; by
            default the process's (``engine.distributed.get_tp_group``, size 1
            outside a group).

    Raises:
        ValueError: the group size does not divide the query heads, the KV
            heads or the MLP width.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or get_tp_group()
        self.model = LlamaModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, "lm_head")
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.num_local_kv_heads = self.model.layers[0].self_attn.num_kv_heads if config.num_hidden_layers else 0
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Run the new tokens of a step through the decoder.

        Args:
            input_ids: ``(T,)`` int64 token ids of all sequences, flattened.
            positions: ``(T,)`` int64 position of each token in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each
                ``(num_blocks, block_size, num_kv_heads, head_dim)``.
            meta: the step's attention metadata.
            backend: the attention backend.

        Returns:
            ``(T, hidden_size)`` final hidden states (after the last norm).
        """
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(positions, x, self.rope, kv_cache, meta, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, hidden)`` -> ``(N, vocab)`` float32 logits (gathered from every rank)."""
        return self.lm_head.compute_logits(hidden)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full-size weights named as in Hugging Face's ``LlamaForCausalLM``.

        q/k/v and gate/up go into their fused matrices; every parallel layer takes
        its rank's slice.

        Raises:
            ValueError: missing or unexpected tensors, or a shape mismatch.
        """
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        modules = dict(self.named_modules())
        expected = {name for name, _ in self.named_parameters()}  # tied lm_head counted once, as embed_tokens
        loaded: set[str] = set()
        unexpected = []
        with torch.no_grad():
            for name, tensor in sd.items():
                target = _fused_target(name)
                if target is None:
                    unexpected.append(name)
                    continue
                module_name, attr, shard = target
                module = modules.get(module_name)
                param = getattr(module, attr, None) if module is not None else None
                if not isinstance(param, nn.Parameter):
                    unexpected.append(name)
                    continue
                if hasattr(module, "load"):
                    module.load(attr, tensor, shard)
                else:
                    check_shape(name, tensor.shape, tuple(param.shape))
                    param.copy_(tensor)
                loaded.add(f"{module_name}.{attr}" + ("" if shard is None else f"#{shard}"))
        missing = sorted(_missing(self, expected, loaded))
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {sorted(unexpected)}")


_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _fused_target(hf_name: str) -> tuple[str, str, int | None] | None:
    """``model.layers.3.self_attn.k_proj.weight`` -> ``("model.layers.3.self_attn.qkv_proj", "weight", 1)``."""
    module_name, _, attr = hf_name.rpartition(".")
    if not module_name or attr not in ("weight", "bias"):
        return None
    parent, _, leaf = module_name.rpartition(".")
    if leaf in _FUSED:
        fused, shard = _FUSED[leaf]
        return f"{parent}.{fused}", attr, shard
    return module_name, attr, None


def _missing(model: nn.Module, expected: set[str], loaded: set[str]) -> list[str]:
    """HF names of the parameters (or fused parts of them) that nothing was loaded into."""
    missing = []
    for name in expected:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, MergedColumnParallelLinear):
            parent = module_name.rpartition(".")[0]
            for shard, part in enumerate(module.names):
                if f"{name.rpartition('.')[0]}.{attr}#{shard}" not in loaded:
                    missing.append(f"{parent}.{part}.{attr}")
        elif name not in loaded:
            missing.append(name)
    return missing
