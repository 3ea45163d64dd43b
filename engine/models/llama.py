"""A Llama-family decoder whose attention reads and writes the paged KV cache.

Architecture as in Touvron et al., "LLaMA" (2023) and Hugging Face's
``LlamaForCausalLM``: RMSNorm, rotary position embeddings (Su et al., RoFormer)
in the rotate-half layout, grouped-query attention (Ainslie et al., 2023), a
SwiGLU MLP, tied or untied output embeddings. Parameter names equal Hugging
Face's, so a HF state dict loads directly.

Tokens of all sequences in a step are flattened into one dimension ``T``; the
attention backend uses ``AttentionMetadata`` to find each token's sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig


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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, positions, x, rope, kv_cache, meta, backend):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # (T, H, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(positions, self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output head.

    Args:
        config: the model's shape.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
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
        """``(N, hidden)`` -> ``(N, vocab)`` float32 logits."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face's ``LlamaForCausalLM``.

        Raises:
            ValueError: missing or unexpected tensors, or a shape mismatch.
        """
        sd = dict(state_dict)
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
        try:
            missing, unexpected = self.load_state_dict(sd, strict=False)
        except RuntimeError as exc:
            raise ValueError(f"weights do not fit the model: {exc}") from exc
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
