"""Kernel tests: Triton's interpreter on machines without CUDA, fresh random data.

``TRITON_INTERPRET`` must be set before Triton is first imported, so it is set
here at import time, and only where no GPU exists (on the GPU the same tests run
the compiled kernels). It changes nothing for tests that do not use Triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels.helpers import KV  # noqa: E402  (after TRITON_INTERPRET is set)


@pytest.fixture
def kv(request) -> KV:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")  # shown on failure
    return KV(seed)
