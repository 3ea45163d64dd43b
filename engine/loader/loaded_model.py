"""What ``load_model`` hands to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from engine.config import ModelConfig


@dataclass
class LoadedModel:
    """A Llama-family model ready for the engine.

    Attributes:
        name: built-in name, or the file/folder stem it was loaded from.
        config: shape of the decoder; ``eos_token_ids`` holds every id that ends
            generation (e.g. ``<|im_end|>`` and ``<|endoftext|>`` for SmolLM2),
            ``bos_token_id`` the id a prompt starts with (or None).
        state_dict: float32 CPU tensors under Hugging Face Llama names, q/k in HF's
            rotate-half RoPE layout:
            ``model.embed_tokens.weight`` (vocab, hidden);
            ``model.layers.{i}.self_attn.q_proj.weight`` (n_heads*head_dim, hidden),
            ``k_proj``/``v_proj`` (n_kv_heads*head_dim, hidden),
            ``o_proj`` (hidden, n_heads*head_dim);
            ``model.layers.{i}.mlp.gate_proj``/``up_proj`` (ffn, hidden), ``down_proj`` (hidden, ffn);
            ``model.layers.{i}.input_layernorm``/``post_attention_layernorm`` (hidden,);
            ``model.norm.weight`` (hidden,); ``lm_head.weight`` (vocab, hidden) only when untied.
        tokenizer: fast tokenizer (``encode``, ``decode``, ``convert_ids_to_tokens``,
            ``apply_chat_template``); its ``chat_template`` is set to ``chat_template``.
        chat_template: Jinja chat template; the model's own (ChatML for SmolLM2), or
            ``FALLBACK_CHAT_TEMPLATE`` (plain concatenation of contents) when the source
            has none.
        hf_dir: a Hugging Face folder (config.json, generation_config.json,
            model.safetensors, tokenizer.json, tokenizer_config.json) holding exactly
            these weights; ``AutoModelForCausalLM.from_pretrained(hf_dir)`` and
            ``AutoTokenizer.from_pretrained(hf_dir)`` load it. For an HF-folder source it
            is that folder itself.
    """

    name: str
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerFast
    chat_template: str | None
    hf_dir: Path
