"""The gateway with tensor_parallel_size=2 (CPU, gloo): the same greedy answers as TP=1, and a
worker killed under it turns into clear errors and an unhealthy /health, never a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx

from engine import SamplingParams
from tests.app.conftest import STORIES_MAX_MODEL_LEN
from tests.app.harness import ChatClient, GatewayServer

PROMPTS = ["Once upon a time there was a cat", "Tom had a red ball"]


def _tp_workers(parent_pid: int) -> list[int]:
    """Pids of the server's spawned worker processes (not multiprocessing's resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_gateway_at_tp2_answers_like_tp1_and_fails_cleanly_when_a_worker_dies(tmp_path, stories_path, stories_llm):
    max_tokens = 32
    expected = [stories_llm.chat([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
                for p in PROMPTS]
    server = GatewayServer(tmp_path, "stories260k", STORIES_MAX_MODEL_LEN,
                           extra_env={"CHATGATE_TENSOR_PARALLEL_SIZE": "2"})
    server.start()
    workers = []
    try:
        workers = _tp_workers(server.proc.pid)
        assert len(workers) == 1, workers

        async def chats():
            client = await ChatClient.connect(server, server.keys["local"])
            try:
                for i, p in enumerate(PROMPTS):
                    await client.create(f"c{i}", [{"role": "user", "content": p}], temperature=0, max_tokens=max_tokens)
                return await asyncio.gather(*(client.collect(f"c{i}") for i in range(len(PROMPTS))))
            finally:
                await client.close()

        for (text, done), want in zip(asyncio.run(chats()), expected):
            assert done["type"] == "chat.done", done
            assert text == want.outputs[0].text

        # An OpenAI-style stream whose worker dies under it ends with an error event and [DONE].
        headers = {"Authorization": f"Bearer {server.keys['local']}"}
        body = {"model": "stories260k", "messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0,
                "max_tokens": 200, "stream": True, "ignore_eos": True}
        lines = []
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 3:  # role chunk and two content chunks: the request is decoding
                    os.kill(workers[0], signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        last_event = json.loads(lines[-2][len("data: "):])
        assert last_event["error"]["code"] == "service_unavailable", last_event

        response = httpx.get(f"{server.base}/health", timeout=5)
        assert response.status_code == 503
        engine = response.json()["engine"]
        assert engine["alive"] is False and "rank 1" in engine["error"]

        async def ws_after_kill():
            client = await ChatClient.connect(server, server.keys["local"])
            try:
                return await client.chat("late", [{"role": "user", "content": PROMPTS[0]}], temperature=0,
                                         max_tokens=max_tokens)
            finally:
                await client.close()

        t0 = time.monotonic()
        _, event = asyncio.run(ws_after_kill())
        assert event["type"] == "error" and event["code"] == "engine_unavailable", event
        assert time.monotonic() - t0 < 60
        plain = httpx.post(f"{server.base}/v1/chat/completions", headers=headers, timeout=30,
                           json={**body, "stream": False, "max_tokens": 8})
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "service_unavailable"
    finally:
        server.stop()
    assert server.proc.returncode is not None
    assert all(not Path(f"/proc/{pid}").exists() for pid in workers)


def test_gateway_at_tp2_reports_a_worker_that_dies_while_idle(tmp_path, stories_path):
    """No request needed: /health turns 503 as soon as the worker is gone, so a load balancer stops routing."""
    server = GatewayServer(tmp_path, "stories260k", STORIES_MAX_MODEL_LEN,
                           extra_env={"CHATGATE_TENSOR_PARALLEL_SIZE": "2"})
    server.start()
    try:
        (worker,) = _tp_workers(server.proc.pid)
        assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            response = httpx.get(f"{server.base}/health", timeout=5)
            if response.status_code == 503:
                break
            time.sleep(0.2)
        assert response.status_code == 503 and "rank 1" in response.json()["engine"]["error"]
    finally:
        server.stop()
