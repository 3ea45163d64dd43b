"""GGUF tensors -> float32 state dict under Hugging Face Llama names, rotate-half RoPE layout."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from tqdm import tqdm

from engine.config import ModelConfig
from engine.loader.errors import ModelLoadError

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when the engine has no use for it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs -> HF rotate-half halves).

    ``w``: (n_head * head_dim, in) or (n_head * head_dim,). Inverse of ``permute`` in
    llama.cpp's convert_hf_to_gguf.py, done as transformers' GGUF loader does
    (``LlamaTensorProcessor._reverse_permute_weights``): rows of each head are stored
    as (head_dim/2, 2) pairs; swap to (2, head_dim/2).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in _BLOCK_NAMES.values()}
    return names


def read_state_dict(reader: gguf.GGUFReader, config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of ``reader`` to float32 (``gguf.quants.dequantize``),
    rename it to HF Llama names, and unpermute q/k. Shows a tqdm bar on stderr.

    Returns:
        name -> float32 contiguous CPU tensor, shapes as in ``LoadedModel.state_dict``.
    Raises:
        ModelLoadError: a tensor is unknown, unreadable, or missing.
    """
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", file=sys.stderr):
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"GGUF file {str(path)!r}: unsupported tensor {tensor.name!r}")
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"GGUF file {str(path)!r}: cannot read tensor {tensor.name!r}: {exc}") from exc
        if ".q_proj." in name:
            w = unpermute_rope(w, config.num_attention_heads)
        elif ".k_proj." in name:
            w = unpermute_rope(w, config.num_key_value_heads)
        # np.array copies: F32 tensors come back as read-only views of the mmap.
        state_dict[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    missing = _expected_names(config) - state_dict.keys()
    if missing:
        raise ModelLoadError(f"GGUF file {str(path)!r}: missing tensors {sorted(missing)[:5]}")
    return state_dict
