"""A client that goes away aborts its request in the engine (streaming and not)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.test_metrics import samples, value

LONG = {"messages": [{"role": "user", "content": "Once upon a time"}], "temperature": 0, "max_tokens": 240,
        "ignore_eos": True}  # fmt: skip


def _aborts(server) -> float:
    snap = samples(httpx.get(f"{server.base}/metrics", timeout=10).text)
    return value(snap, "vllm:request_success_total", model_name="stories260k", finished_reason="abort")


def _wait_for_aborts(server, at_least: float, within_s: float = 10.0) -> float:
    deadline = time.monotonic() + within_s
    while (n := _aborts(server)) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def test_closing_a_stream_aborts_the_request(openai_gateway, model_name):
    before = _aborts(openai_gateway)
    headers = {"Authorization": f"Bearer {openai_gateway.keys['alpha']}"}
    body = {**LONG, "model": model_name, "stream": True}
    with httpx.stream("POST", f"{openai_gateway.base}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk: generation is under way; now hang up
    assert _wait_for_aborts(openai_gateway, before + 1) == before + 1
    health = openai_gateway.health()["engine"]
    assert health["running"] == 0 and health["free_kv_blocks"] == health["total_kv_blocks"]


def test_a_non_streaming_client_that_times_out_aborts_the_request(openai_gateway, model_name):
    before = _aborts(openai_gateway)
    headers = {"Authorization": f"Bearer {openai_gateway.keys['alpha']}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{openai_gateway.base}/v1/chat/completions", json={**LONG, "model": model_name},
                   headers=headers, timeout=httpx.Timeout(5.0, read=0.05))  # fmt: skip
    assert _wait_for_aborts(openai_gateway, before + 1) == before + 1
