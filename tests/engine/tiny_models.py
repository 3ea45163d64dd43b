"""Tiny random Llama models built with transformers, shared by engine tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ModelConfig
from engine.llm_engine import EngineConfig, LLMEngine

# (name, kwargs): MHA and GQA, tied and untied, odd sizes.
TINY_CONFIGS = {
    "mha_untied": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                       num_hidden_layers=2, vocab_size=101, tie_word_embeddings=False),
    "gqa_tied": dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2,
                     num_hidden_layers=3, vocab_size=97, tie_word_embeddings=True, rope_theta=500000.0),
    "gqa_odd_headdim": dict(hidden_size=40, intermediate_size=72, num_attention_heads=5, num_key_value_heads=1,
                            num_hidden_layers=2, vocab_size=131, tie_word_embeddings=False, head_dim=24),
}


def make_hf_model(name: str, seed: int = 0, max_positions: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=max_positions, rms_norm_eps=1e-5, **TINY_CONFIGS[name])
    model = LlamaForCausalLM(cfg).eval()
    # Random init is small and nearly uniform; sharpen it so greedy choices are decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def model_config_from_hf(hf: LlamaForCausalLM) -> ModelConfig:
    c = hf.config
    return ModelConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None),
        rms_norm_eps=c.rms_norm_eps, rope_theta=getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"],
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
    )


def engine_for(hf: LlamaForCausalLM, **kwargs) -> LLMEngine:
    return LLMEngine(model_config_from_hf(hf), hf.state_dict(), None, EngineConfig(**kwargs))


@torch.no_grad()
def hf_greedy_ids(hf: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, one prompt at a time, EOS ignored."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()
