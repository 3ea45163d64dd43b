"""``load_model``: a built-in name, a GGUF file or a Hugging Face folder -> ``LoadedModel``."""

from __future__ import annotations

from pathlib import Path

from engine.loader import hf_folder
from engine.loader.cache import DEFAULT_CACHE_DIR, cached_folder, fingerprint
from engine.loader.errors import ModelLoadError
from engine.loader.loaded_model import LoadedModel
from engine.loader.registry import resolve


def load_model(name_or_path: str, *, cache_dir: Path | None = None) -> LoadedModel:
    """Load a Llama-family model for the engine.

    Args:
        name_or_path: a built-in name (``"smollm2-135m-instruct"``, ``"stories260k"``),
            a ``.gguf`` file, or a Hugging Face folder (config.json, one or more
            ``*.safetensors`` shards, tokenizer.json).
        cache_dir: where GGUF conversions are cached as Hugging Face folders; default
            ``~/.cache/chatgate/models``. The first load of a GGUF file dequantizes it
            (tqdm bar on stderr) and writes ``<cache_dir>/<name>-<fingerprint>``
            atomically; later loads read that folder.

    Returns:
        ``LoadedModel`` with float32 weights under HF names (see its docstring).

    Raises:
        ModelLoadError: unknown name, missing path, unreadable or corrupt file,
            unsupported architecture, or a tokenizer that cannot be built.
    """
    name, path = resolve(name_or_path)
    if path.is_dir():
        return _from_hf_folder(name, path)
    if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
        raise ModelLoadError(f"model file {str(path)!r} is neither a GGUF file nor a model folder")
    key = f"{name}-{fingerprint(path)}"
    folder = cached_folder(cache_dir or DEFAULT_CACHE_DIR, key, lambda tmp: _convert_gguf(path, tmp))
    return _from_hf_folder(name, folder)


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _convert_gguf(path: Path, folder: Path) -> None:
    # Imported here: Hugging Face folders load without the gguf package (the GPU image lacks it).
    from engine.loader import gguf_meta, gguf_tokenizer, gguf_weights

    reader = gguf_meta.open_gguf(path)
    config = gguf_meta.read_config(reader, path)
    tokenizer = gguf_tokenizer.gguf_tokenizer(reader, path)
    state_dict = gguf_weights.read_state_dict(reader, config, path)
    hf_folder.write_hf_folder(folder, config, state_dict, tokenizer)


def _from_hf_folder(name: str, folder: Path) -> LoadedModel:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(folder)!r} has no config.json")
    tokenizer = hf_folder.read_tokenizer(folder)
    config = hf_folder.read_config(folder, tokenizer)
    state_dict = hf_folder.read_state_dict(folder, config)
    return LoadedModel(
        name=name,
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        hf_dir=folder,
    )
