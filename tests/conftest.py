"""Shared fixtures: model files and session-scoped loaded models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in its interpreter where no GPU exists; this must be set before
# Triton is first imported, by whichever test imports it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
_STORIES_CANDIDATES = (
    Path("/work/shared/models/stories260K.gguf"),
    REPO_ROOT.parent / "shared" / "models" / "stories260K.gguf",
)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    """stories260K.gguf from the shared models folder (never committed)."""
    for path in _STORIES_CANDIDATES:
        if path.is_file():
            return path
    pytest.skip(f"stories260K.gguf is absent (looked in {', '.join(map(str, _STORIES_CANDIDATES))})")


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh conversion cache for this test session."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def stories_model(stories_path: Path, model_cache_dir: Path):
    from engine.loader import load_model

    return load_model(str(stories_path), cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def smollm2_model(model_cache_dir: Path):
    from engine.loader import load_model

    return load_model("smollm2-135m-instruct", cache_dir=model_cache_dir)
