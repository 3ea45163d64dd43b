"""A GGUF file's tokenizer as a ``transformers`` fast tokenizer.

We use transformers' own GGUF tokenizer conversion (``AutoTokenizer.from_pretrained(
folder, gguf_file=...)``), which builds a ``tokenizers`` BPE (byte-level for gpt2-type
vocabularies; SentencePiece-style with byte fallback for llama-type ones). It trusts
every special-token id in the file and fails on llama2.c exports (stories260K), whose
absent ids are written as 4294967295. So we first copy the tokenizer metadata, minus
out-of-range ids and minus all tensors, into a small sanitized GGUF and convert that.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.loader.errors import ModelLoadError
from engine.loader.gguf_meta import field

# Used when the source has no chat template (stories260K): the message contents
# concatenated in order, no roles, no markers; ``add_generation_prompt`` adds nothing.
# A plain-text completion model then continues the last content.
from engine.loader.errors import FALLBACK_CHAT_TEMPLATE  # noqa: E402 - re-exported

_ID_KEYS = ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask", "eot", "eom")


def _write_sanitized(reader: gguf.GGUFReader, out: Path, vocab_size: int) -> None:
    writer = gguf.GGUFWriter(out, field(reader, "general.architecture"))
    for key, f in reader.fields.items():
        # general.architecture is written by GGUFWriter itself.
        if key.startswith("GGUF.") or key == "general.architecture" or not key.startswith(("tokenizer.", "general.")):
            continue
        value = f.contents()
        if key.endswith("_token_id") and not (isinstance(value, int) and 0 <= value < vocab_size):
            continue  # NOTE: llama2.c writes 4294967295 for "no such token"
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, value, f.types[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def gguf_tokenizer(reader: gguf.GGUFReader, path: Path) -> PreTrainedTokenizerFast:
    """Build the tokenizer stored in a GGUF file.

    The chat template is the file's ``tokenizer.chat_template``, else
    ``FALLBACK_CHAT_TEMPLATE``.

    Raises:
        ModelLoadError: the file has no vocabulary or transformers cannot convert it.
    """
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"GGUF file {str(path)!r} has no tokenizer vocabulary")
    with tempfile.TemporaryDirectory(prefix="chatgate-tok-") as tmp:
        _write_sanitized(reader, Path(tmp) / "tokenizer.gguf", len(tokens))
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file="tokenizer.gguf")
        except Exception as exc:
            raise ModelLoadError(f"GGUF file {str(path)!r}: cannot build its tokenizer: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"GGUF file {str(path)!r}: got a slow tokenizer {type(tokenizer).__name__}")
    tokenizer.chat_template = field(reader, "tokenizer.chat_template") or FALLBACK_CHAT_TEMPLATE
    return tokenizer
