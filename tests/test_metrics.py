"""``/metrics``: parses with the Prometheus text parser, uses vLLM's names, and moves as requests run."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import Metrics
from tenancy.records import Quotas
from tests.app.harness import ChatClient, GatewayServer

VLLM_NAMES = {
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:request_success", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_preemptions",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
}  # fmt: skip
CHATGATE_NAMES = {"chatgate:tenant_prompt_tokens", "chatgate:tenant_generation_tokens", "chatgate:quota_refusals"}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition as {(sample name, labels): value}; fails on text that does not parse."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(snapshot: dict, name: str, **labels: str) -> float:
    return snapshot.get((name, frozenset(labels.items())), 0.0)


def test_engine_gauges_and_counters_come_from_stats():
    stats = {"num_running": 3, "num_waiting": 2, "num_swapped": 1, "free_gpu_blocks": 25, "total_gpu_blocks": 100,
             "num_preemptions": 7, "prefix_cache_queried_tokens": 400, "prefix_cache_hit_tokens": 150}  # fmt: skip
    m = Metrics("tiny", lambda: stats)
    text = m.render().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert VLLM_NAMES | CHATGATE_NAMES <= names
    snap = samples(text)
    assert value(snap, "vllm:num_requests_running", model_name="tiny") == 3
    assert value(snap, "vllm:num_requests_waiting", model_name="tiny") == 2
    assert value(snap, "vllm:num_requests_swapped", model_name="tiny") == 1
    assert value(snap, "vllm:kv_cache_usage_perc", model_name="tiny") == pytest.approx(0.75)
    assert value(snap, "vllm:num_preemptions_total", model_name="tiny") == 7
    assert value(snap, "vllm:prefix_cache_queries_total", model_name="tiny") == 400
    assert value(snap, "vllm:prefix_cache_hits_total", model_name="tiny") == 150


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, stories_path) -> GatewayServer:
    s = GatewayServer(tmp_path_factory.mktemp("metrics-gateway"), "stories260k", 256)
    s.start()
    try:
        s.add_tenant("alpha")
        s.add_tenant("limited", quotas=Quotas(requests_per_minute=1))
        yield s
    finally:
        s.stop()


def scrape(server: GatewayServer) -> dict:
    r = httpx.get(f"{server.base}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


def _chat_openai(server: GatewayServer, tenant: str, max_tokens: int) -> httpx.Response:
    body = {"model": "stories260k", "messages": [{"role": "user", "content": "Tom had a red ball"}],
            "temperature": 0, "max_tokens": max_tokens}  # fmt: skip
    return httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.keys[tenant]}"})  # fmt: skip


def test_counters_move_as_requests_run(server: GatewayServer):
    before = scrape(server)
    model = {"model_name": "stories260k"}
    r = _chat_openai(server, "alpha", 12)
    assert r.status_code == 200
    usage = r.json()["usage"]

    async def ws_chat():
        client = await ChatClient.connect(server, server.keys["local"])
        try:
            return await client.chat("a", [{"role": "user", "content": "Lily wanted to play"}], temperature=0,
                                     max_tokens=9)  # fmt: skip
        finally:
            await client.close()

    _, done = asyncio.run(ws_chat())
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompt = usage["prompt_tokens"] + done["usage"]["prompt_tokens"]
    generated = usage["completion_tokens"] + done["usage"]["completion_tokens"]
    assert delta("vllm:prompt_tokens_total", **model) == prompt
    assert delta("vllm:generation_tokens_total", **model) == generated
    assert delta("vllm:time_to_first_token_seconds_count", **model) == 2
    assert delta("vllm:e2e_request_latency_seconds_count", **model) == 2
    assert delta("vllm:inter_token_latency_seconds_count", **model) == generated - 2
    assert delta("vllm:request_success_total", finished_reason="length", **model) == 2
    assert delta("vllm:request_generation_tokens_sum", **model) == generated
    # Per tenant, by name, whichever transport (the WebSocket tenant is named at scrape time).
    assert delta("chatgate:tenant_generation_tokens_total", tenant="alpha") == usage["completion_tokens"]
    assert delta("chatgate:tenant_prompt_tokens_total", tenant="local") == done["usage"]["prompt_tokens"]
    assert delta("chatgate:tenant_generation_tokens_total", tenant="local") == done["usage"]["completion_tokens"]
    # Idle again: nothing running, the KV pool back to empty.
    assert value(after, "vllm:num_requests_running", **model) == 0
    assert value(after, "vllm:kv_cache_usage_perc", **model) == 0


def test_quota_refusals_are_counted_per_tenant_and_quota(server: GatewayServer):
    before = scrape(server)
    statuses = [_chat_openai(server, "limited", 2).status_code for _ in range(3)]
    assert statuses[0] == 200 and statuses[1:] == [429, 429]
    after = scrape(server)
    key = ("chatgate:quota_refusals_total", frozenset({"tenant": "limited", "quota": "requests_per_minute"}.items()))
    assert after[key] - before.get(key, 0.0) == 2
