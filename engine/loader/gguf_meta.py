"""Reading a GGUF file's metadata into a ``ModelConfig``, with the known quirks fixed.

GGUF key names: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf

from engine.config import ModelConfig
from engine.loader.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)

# Texts llama.cpp treats as end-of-generation when a file does not mark them itself
# (llama-vocab.cpp: the EOG set built from token texts).
EOG_TEXTS = frozenset({
    "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
    "<end_of_turn>", "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
})

# Files whose declared context is not the one they were trained on, keyed by
# (size in bytes, sha256). stories260K is exported by llama2.c (karpathy), whose
# export writes context_length 2048 for every model, but it was trained with
# max_seq_len 512 (llama2.c README, "stories260K"); positions past 512 are noise.
# NOTE: an exact fingerprint rather than a name heuristic: llama2.c files all call
# themselves "llama", and a size check first keeps hashing off every large file.
CONTEXT_OVERRIDES: dict[tuple[int, str], int] = {
    (1_185_376, "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"): 512,
}


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open ``path`` with the gguf package's reader (memory-mapped).

    Raises:
        ModelLoadError: the file is missing, truncated, or not GGUF.
    """
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError...
        raise ModelLoadError(f"GGUF file {str(path)!r} is unreadable or corrupt: {exc}") from exc


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool or list)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def valid_token_id(reader: gguf.GGUFReader, key: str, vocab_size: int) -> int | None:
    """A special-token id, or None when absent or out of range.

    NOTE: llama2.c exports write 4294967295 (uint32 -1) for "no such token"."""
    value = field(reader, key)
    return value if isinstance(value, int) and 0 <= value < vocab_size else None


def architecture(reader: gguf.GGUFReader, path: Path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {str(path)!r}: unsupported architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def eos_token_ids(reader: gguf.GGUFReader, vocab_size: int) -> tuple[int, ...]:
    """Every id that ends generation: eos/eot/eom ids plus control tokens whose text is
    a known end-of-generation marker (SmolLM2: ``<|im_end|>`` and ``<|endoftext|>``)."""
    ids = [valid_token_id(reader, f"tokenizer.ggml.{k}_token_id", vocab_size) for k in ("eos", "eot", "eom")]
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    types = field(reader, "tokenizer.ggml.token_type", [])
    control = int(gguf.TokenType.CONTROL)
    ids += [i for i, (text, kind) in enumerate(zip(tokens, types)) if kind == control and text in EOG_TEXTS]
    return tuple(sorted({i for i in ids if i is not None}))


def _context_override(path: Path) -> int | None:
    size = path.stat().st_size
    candidates = {sha: n for (s, sha), n in CONTEXT_OVERRIDES.items() if s == size}
    if not candidates:
        return None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return candidates.get(digest)


def read_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """The ``ModelConfig`` a GGUF file describes.

    Raises:
        ModelLoadError: unsupported architecture or a required key missing.
    """
    arch = architecture(reader, path)
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file {str(path)!r}: metadata key {arch}.{key} is missing")
        return value

    n_heads = need("attention.head_count")
    hidden = need("embedding_length")
    context = _context_override(path) or field(reader, f"{arch}.context_length", 2048)
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=need("block_count"),
            num_attention_heads=n_heads,
            num_key_value_heads=field(reader, f"{arch}.attention.head_count_kv", n_heads),
            head_dim=field(reader, f"{arch}.attention.key_length", hidden // n_heads),
            rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=valid_token_id(reader, "tokenizer.ggml.bos_token_id", vocab_size),
            eos_token_ids=eos_token_ids(reader, vocab_size),
        )
    except ValueError as exc:
        raise ModelLoadError(f"GGUF file {str(path)!r}: inconsistent metadata: {exc}") from exc
