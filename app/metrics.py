"""Prometheus metrics at ``/metrics``, named as vLLM names them so existing dashboards work.

Three sources:

- **per request** (histograms and token counters), observed by :class:`InstrumentedLLM`,
  a wrapper around the engine client that every chat path (WebSocket, OpenAI HTTP)
  already goes through: TTFT, inter-token latency, end-to-end latency, queue time,
  prompt and generation tokens, finished requests by reason; plus per-tenant tokens.
- **engine state** (gauges and the engine's own counters), read from
  ``AsyncLLM.stats()`` at scrape time by :class:`EngineCollector`: running, waiting
  and swapped requests, KV cache usage, prefix cache queries and hits, preemptions.
- **gateway events**: quota refusals per tenant and quota (:meth:`Metrics.quota_refused`).

vLLM names kept (meaning identical): ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` (and its older alias
``vllm:time_per_output_token_seconds``), ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total``,
``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens`` (histograms),
``vllm:num_requests_running|waiting|swapped``, ``vllm:kv_cache_usage_perc`` (and the
V0 alias ``vllm:gpu_cache_usage_perc``), ``vllm:num_preemptions_total``,
``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (both in
tokens). Every vLLM metric carries a ``model_name`` label. chatgate's own metrics
(tenants, quotas) use the ``chatgate:`` prefix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from app.logging_setup import bind_request_id

log = logging.getLogger("chatgate.requests")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    """The gateway's metrics in a registry of their own (several apps may live in one process).

    Args:
        model_name: the served model (the ``model_name`` label).
        stats: returns the engine's counters (``AsyncLLM.stats``), called at scrape time.
    """

    def __init__(self, model_name: str, stats: Callable[[], dict]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_names: dict[str, str] = {}  # engine tenant id -> tenant name (label)
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token), s.",
                              m, buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens, s.",
                             m, buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token (alias of the ITL), s.",
                              m, buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token, s.",
                             m, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled, s.",
                               m, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                        m, buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                            m, buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.quota_refusals = Counter("chatgate:quota_refusals", "Requests refused by a tenant quota.",
                                      ["tenant", "quota"], registry=r)  # fmt: skip
        self._tenant_tokens: dict[tuple[str, str], int] = {}  # (tenant id, "prompt"|"generation") -> tokens
        r.register(EngineCollector(model_name, stats))
        r.register(_TenantTokenCollector(self))

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)

    def note_tenant(self, tenant_id: int | str, name: str) -> None:
        """Remember a tenant's name for its labels (ids are what the engine sees)."""
        self.tenant_names[str(tenant_id)] = name

    def quota_refused(self, tenant: str, quota: str) -> None:
        self.quota_refusals.labels(tenant, quota).inc()

    def add_tenant_tokens(self, tenant_id: str | None, kind: str, n: int) -> None:
        key = (tenant_id or "", kind)
        self._tenant_tokens[key] = self._tenant_tokens.get(key, 0) + n

    def tenant_label(self, tenant_id: str) -> str:
        return self.tenant_names.get(tenant_id, tenant_id or "none")


class _TenantTokenCollector:
    """Per-tenant token counters, labelled by name at scrape time (names may arrive after the tokens)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def describe(self) -> list:
        return []

    def collect(self):
        m = self._m
        families = {
            kind: CounterMetricFamily(f"chatgate:tenant_{kind}_tokens", f"{kind.capitalize()} tokens per tenant.",
                                      labels=["tenant"])  # fmt: skip
            for kind in ("prompt", "generation")
        }
        for (tenant_id, kind), n in sorted(m._tenant_tokens.items()):
            families[kind].add_metric([m.tenant_label(tenant_id)], n)
        yield from families.values()


class EngineCollector:
    """Engine gauges and counters from ``stats()`` at scrape time (no polling thread)."""

    def __init__(self, model_name: str, stats: Callable[[], dict]) -> None:
        self._model = model_name
        self._stats = stats

    def describe(self) -> list:
        return []

    def collect(self):
        s = self._stats()
        label = [self._model]

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, float(value or 0))
            return g

        def counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, float(value or 0))
            return c

        total = s.get("total_gpu_blocks") or 0
        usage = 1.0 - (s.get("free_gpu_blocks") or 0) / total if total else 0.0
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.get("num_running"))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting"))
        yield gauge("vllm:num_requests_swapped", "Requests swapped out to CPU memory.", s.get("num_swapped"))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of GPU KV cache blocks in use (0-1).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Fraction of GPU KV cache blocks in use (0-1; V0 name).", usage)
        yield gauge("chatgate:kv_cache_total_blocks", "GPU KV cache blocks in the pool.", total)
        yield gauge("chatgate:kv_cache_free_blocks", "Free GPU KV cache blocks.", s.get("free_gpu_blocks"))
        cpu_total = s.get("total_cpu_blocks") or 0
        cpu_usage = 1.0 - (s.get("free_cpu_blocks") or 0) / cpu_total if cpu_total else 0.0
        yield gauge("vllm:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (0-1).", cpu_usage)
        yield counter("vllm:num_preemptions", "Preemptions (swap or recompute).", s.get("num_preemptions"))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queried_tokens"))  # fmt: skip
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hit_tokens"))  # fmt: skip
        yield counter("chatgate:swapped_out_blocks", "KV blocks copied to the CPU pool.", s.get("num_swapped_out_blocks"))
        yield counter("chatgate:swapped_in_blocks", "KV blocks copied back to the GPU.", s.get("num_swapped_in_blocks"))


class InstrumentedLLM:
    """The engine client with metrics and one structured log line per request.

    Everything but ``generate`` is passed through to the wrapped ``AsyncLLM``.
    ``generate`` also binds the request id to the task's logs
    (:func:`app.logging_setup.bind_request_id`), and with ``log_prompts`` logs the
    prompt and the answer (the ``log_prompts`` setting; never in production).
    """

    def __init__(self, llm: Any, metrics: Metrics, *, log_prompts: bool = False) -> None:
        self._llm = llm
        self.metrics = metrics
        self.log_prompts = log_prompts  # debugging only: prompts and answers in the logs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str, **kwargs: Any) -> AsyncIterator:
        bind_request_id(request_id)
        tracker = _RequestTracker(self.metrics, kwargs.get("tenant_id"), len(prompt_token_ids))
        if self.log_prompts:
            log.info("prompt", extra={"fields": {"prompt": self._llm.tokenizer.decode(prompt_token_ids)}})
        stream = self._llm.generate(prompt_token_ids, params, request_id, **kwargs)
        try:
            async for out in stream:
                tracker.on_output(out)
                yield out
        except Exception:
            tracker.refused = tracker.last is None  # refused before it ran: not a finished request
            raise
        finally:
            try:
                await stream.aclose()
            finally:
                tracker.finish()  # even when a cancelled scope interrupts the close
                if self.log_prompts and tracker.last is not None:
                    log.info("answer", extra={"fields": {"answer": tracker.last.outputs[0].text}})


class MeteredChatService:
    """The chat service with per-tenant refusal counts and tenant names for the labels.

    Passes everything through to the wrapped ``app.chat_service.ChatService``;
    ``run`` counts a ``QuotaExceededError`` (``chatgate:quota_refusals_total``) and
    re-raises it, whatever the transport.
    """

    def __init__(self, service: Any, metrics: Metrics) -> None:
        self._service = service
        self.metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)

    async def run(self, principal: Any, *args: Any, **kwargs: Any) -> AsyncIterator:
        from tenancy.errors import QuotaExceededError

        self.metrics.note_tenant(principal.tenant_id, principal.tenant_name)
        stream = self._service.run(principal, *args, **kwargs)
        try:
            async for out in stream:
                yield out
        except QuotaExceededError as exc:
            self.metrics.quota_refused(principal.tenant_name, exc.quota_name)
            raise
        finally:
            await stream.aclose()


class _RequestTracker:
    """Per-request timing: TTFT and e2e from the engine's timestamps, ITL as outputs arrive."""

    def __init__(self, metrics: Metrics, tenant_id: str | None, num_prompt_tokens: int) -> None:
        self.m = metrics
        self.tenant_id = tenant_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0
        self.last_token_time: float | None = None
        self.last: Any = None
        self.refused = False
        self.started = time.monotonic()

    def on_output(self, out: Any) -> None:
        self.last = out
        n = len(out.outputs[0].token_ids) - self.num_tokens
        if n <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is not None:
            per_token = (now - self.last_token_time) / n
            for _ in range(n):
                self.m.itl.labels(self.m.model_name).observe(per_token)
                self.m.tpot.labels(self.m.model_name).observe(per_token)
        self.last_token_time = now
        self.num_tokens += n

    def finish(self) -> None:
        if self.refused:
            return
        m, label, out = self.m, self.m.model_name, self.last
        metrics = getattr(out, "metrics", None)
        arrival = getattr(metrics, "arrival_time", None)
        first = getattr(metrics, "first_token_time", None)
        scheduled = getattr(metrics, "first_scheduled_time", None)
        finished = getattr(metrics, "finished_time", None) or time.monotonic()
        reason = (out.outputs[0].finish_reason if out is not None else None) or "abort"
        if arrival is not None and first is not None:
            m.ttft.labels(label).observe(first - arrival)
        if arrival is not None:
            m.e2e.labels(label).observe(finished - arrival)
            if scheduled is not None:
                m.queue.labels(label).observe(scheduled - arrival)
        m.request_prompt.labels(label).observe(self.num_prompt_tokens)
        m.request_generation.labels(label).observe(self.num_tokens)
        m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(label).inc(self.num_tokens)
        m.success.labels(label, reason).inc()
        m.add_tenant_tokens(self.tenant_id, "prompt", self.num_prompt_tokens)
        m.add_tenant_tokens(self.tenant_id, "generation", self.num_tokens)
        log.info(
            "request finished",
            extra={"fields": {
                "tenant": m.tenant_label(self.tenant_id or ""), "finish_reason": reason,
                "prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "ttft_s": round(first - arrival, 4) if arrival is not None and first is not None else None,
                "e2e_s": round(time.monotonic() - self.started, 4),
            }},
        )  # fmt: skip


async def metrics_endpoint(request: Any) -> Any:
    """``GET /metrics``: the Prometheus exposition (no authentication; bind it to a private network)."""
    from starlette.responses import Response

    state = request.app.state
    metrics: Metrics = state.metrics
    await _resolve_tenant_names(metrics, getattr(state, "store", None))
    return Response(metrics.render(), media_type=CONTENT_TYPE)


async def _resolve_tenant_names(metrics: Metrics, store: Any) -> None:
    """Name tenants seen only by id (WebSocket chats) from the store; ids stay as labels if it is down."""
    unknown = {tid for tid, _ in metrics._tenant_tokens if tid and tid not in metrics.tenant_names}
    if not unknown or store is None:
        return
    try:
        for tenant in await store.list_tenants():
            metrics.note_tenant(tenant.id, tenant.name)
    except Exception:  # noqa: BLE001 - a scrape must not fail because the database is down
        log.warning("metrics: tenant names unavailable (store down); labelling by tenant id")
