"""Fixtures: the real gateway on stories260k (fast) and an offline engine to compare with."""

from __future__ import annotations

import pytest

from tests.app.harness import GatewayServer

STORIES_MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory, stories_path) -> GatewayServer:
    """``chatgate serve`` on stories260k with tenants local (bootstrap), alpha, beta."""
    server = GatewayServer(
        tmp_path_factory.mktemp("gateway"), "stories260k", STORIES_MAX_MODEL_LEN,
        extra_env={"CHATGATE_AUTH_TIMEOUT_S": "1.5"},
    )  # fmt: skip
    server.start()
    try:
        server.add_tenant("alpha", allowed_priorities={"interactive", "standard", "batch"})
        server.add_tenant("beta", weight=2.0, allowed_priorities={"standard", "batch"})
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def stories_llm(stories_path):
    """The offline engine on the same model and context length as the gateway."""
    from engine import LLM

    return LLM("stories260k", max_model_len=STORIES_MAX_MODEL_LEN)
