"""``chatgate serve`` refuses bad engine options and models in one line on stderr, exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.app.harness import REPO_ROOT, free_port


def _serve(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(free_port()),
           "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TQDM_DISABLE": "1", **(env or {})})


@pytest.mark.parametrize("args, message", [
    (("--model", "stories260k", "--tensor-parallel-size", "3"), "tensor_parallel_size 3 does not divide"),
    (("--model", "no-such-model"), "unknown model 'no-such-model'"),
    (("--model", "stories260k", "--tensor-parallel-size", "0"), "tensor_parallel_size: Input should be greater"),
])
def test_bad_engine_options_fail_fast_in_one_line(tmp_path, stories_path, args, message):
    done = _serve(tmp_path, *args)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("chatgate serve:")]
    assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
