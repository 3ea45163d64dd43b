"""On-disk cache of converted GGUF files, one Hugging Face folder per file content."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# Bump when the conversion changes, so stale folders are not reused.
LOADER_VERSION = 1
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "chatgate" / "models"
_CHUNK = 1 << 20  # bytes hashed at each end of the file


def fingerprint(path: Path) -> str:
    """16 hex digits of sha256 over the file size, its first and its last MiB.

    NOTE: the head holds all metadata, the tail the last tensors' data; hashing the
    whole of a multi-GB file on every load would cost seconds. mtime is left out so a
    copied file still hits the cache.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:v{LOADER_VERSION}:".encode())
    with path.open("rb") as f:
        h.update(f.read(_CHUNK))
        if size > _CHUNK:
            f.seek(max(_CHUNK, size - _CHUNK))
            h.update(f.read(_CHUNK))
    return h.hexdigest()[:16]


def cached_folder(cache_dir: Path, key: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir/key``, built by ``build(tmp_folder)`` on a miss and published with an
    atomic rename, so readers never see a half-written folder. Returns the folder."""
    final = cache_dir / key
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a concurrent loader losing the race is fine
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
