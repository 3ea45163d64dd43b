"""Reading and writing Hugging Face format folders (config.json, *.safetensors, tokenizer)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from engine.config import ModelConfig
from engine.loader.errors import ModelLoadError
from engine.loader.errors import FALLBACK_CHAT_TEMPLATE

SUPPORTED_MODEL_TYPES = ("llama",)
_LLAMA_KEYS = ("embed_tokens", "layers.", "norm.weight")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc


def read_config(folder: Path, tokenizer: PreTrainedTokenizerFast) -> ModelConfig:
    """``ModelConfig`` from ``folder/config.json`` (+ generation_config.json, tokenizer eos).

    Raises:
        ModelLoadError: missing/unreadable config, a non-Llama model type, or RoPE scaling.
    """
    cfg = _read_json(folder / "config.json")
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"model folder {str(folder)!r}: unsupported model_type {cfg.get('model_type')!r}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelLoadError(f"model folder {str(folder)!r}: unsupported RoPE scaling {rope}")
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    eos = _ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id")) + _ids(tokenizer.eos_token_id)
    try:
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            eos_token_ids=tuple(sorted(set(eos))),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"model folder {str(folder)!r}: bad config.json: {exc!r}") from exc


def read_state_dict(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All ``*.safetensors`` shards of ``folder`` as float32 tensors under HF Llama names.

    Drops a redundant ``lm_head.weight`` when embeddings are tied.

    Raises:
        ModelLoadError: no shards, a corrupt shard, or a missing output head.
    """
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"model folder {str(folder)!r} has no *.safetensors file")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            tensors = load_file(shard)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights {str(shard)!r}: {exc}") from exc
        for name, t in tensors.items():
            if name.startswith(("model.", "lm_head.")) and "rotary_emb" not in name:
                state_dict[name] = t.to(torch.float32)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state_dict:
        raise ModelLoadError(f"model folder {str(folder)!r}: untied model without lm_head.weight")
    return state_dict


def read_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer of ``folder``; its chat template defaults to the fallback.

    Raises:
        ModelLoadError: the tokenizer cannot be loaded or is not a fast tokenizer.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"model folder {str(folder)!r}: cannot load tokenizer: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"model folder {str(folder)!r}: no fast tokenizer (tokenizer.json)")
    if not tokenizer.chat_template:
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def write_hf_folder(
    folder: Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files into the (existing, empty) ``folder``."""
    eos = list(config.eos_token_ids)
    eos_value: int | list[int] | None = eos[0] if len(eos) == 1 else (eos or None)
    fields = {k: v for k, v in asdict(config).items() if k != "eos_token_ids"}
    LlamaConfig(**fields, eos_token_id=eos_value, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos_value).save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
