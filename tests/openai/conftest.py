"""Fixtures: the real gateway (``chatgate serve`` on stories260k) and ``openai`` clients pointed at it."""

from __future__ import annotations

import pytest

from tenancy.records import Quotas
from tests.app.harness import GatewayServer

STORIES_MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def openai_gateway(tmp_path_factory: pytest.TempPathFactory, stories_path) -> GatewayServer:
    """The gateway with tenants ``alpha`` (unlimited), ``rpm`` (1 request a minute) and
    ``broke`` (a 10-token daily budget)."""
    pytest.importorskip("openai")
    server = GatewayServer(tmp_path_factory.mktemp("openai-gateway"), "stories260k", STORIES_MAX_MODEL_LEN)
    server.start()
    try:
        server.add_tenant("alpha", allowed_priorities={"interactive", "standard", "batch"})
        server.add_tenant("rpm", quotas=Quotas(requests_per_minute=1))
        server.add_tenant("broke", quotas=Quotas(tokens_per_day=10))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def model_name(openai_gateway: GatewayServer) -> str:
    return openai_gateway.health()["model"]


def make_client(server: GatewayServer, key: str, **kwargs):
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)


def make_async_client(server: GatewayServer, key: str, **kwargs):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)
