"""The official ``openai`` package against ``chatgate serve`` on stories260k: chat completions."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.app.harness import ChatClient, GatewayServer
from tests.openai.conftest import make_async_client, make_client

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Once upon a time there was a cat"}]


def _ws_answer(server: GatewayServer, key: str, messages: list[dict], **params) -> tuple[str, dict]:
    async def go():
        client = await ChatClient.connect(server, key)
        try:
            return await client.chat("c", messages, **params)
        finally:
            await client.close()

    return asyncio.run(go())


def test_models_lists_the_served_model(openai_gateway, model_name):
    models = make_client(openai_gateway, openai_gateway.keys["alpha"]).models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].owned_by == "chatgate"


def test_non_streaming_greedy_text_and_usage_equal_the_websocket_answer(openai_gateway, model_name):
    key = openai_gateway.keys["alpha"]
    text, done = _ws_answer(openai_gateway, key, MESSAGES, temperature=0, max_tokens=40)
    r = make_client(openai_gateway, key).chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0, max_tokens=40
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text and text
    assert r.choices[0].finish_reason == done["finish_reason"]
    assert r.usage.prompt_tokens == done["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == done["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_sends_role_then_deltas_then_finish_then_usage(openai_gateway, model_name):
    key = openai_gateway.keys["alpha"]
    text, done = _ws_answer(openai_gateway, key, MESSAGES, temperature=0, max_tokens=40)
    stream = make_client(openai_gateway, key).chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    body, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert len(body) > 3  # streamed, not one lump
    assert [c.choices[0].finish_reason for c in body[:-1]] == [None] * (len(body) - 1)
    assert body[-1].choices[0].finish_reason == done["finish_reason"]
    assert usage_chunk.choices == [] and all(c.usage is None for c in body)
    assert usage_chunk.usage.prompt_tokens == done["usage"]["prompt_tokens"]
    assert usage_chunk.usage.completion_tokens == done["usage"]["completion_tokens"]


def test_stream_without_include_usage_has_no_usage_chunk_and_ends_with_done(openai_gateway, model_name):
    body = {"model": model_name, "messages": MESSAGES, "temperature": 0, "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {openai_gateway.keys['alpha']}"}
    with httpx.stream("POST", f"{openai_gateway.base}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_async_streams_all_get_their_greedy_answers(openai_gateway, model_name):
    prompts = ["Tom had a red ball", "Lily wanted to play", "A big dog ran", "Sam found a box"]
    key = openai_gateway.keys["alpha"]
    expected = {p: _ws_answer(openai_gateway, key, [{"role": "user", "content": p}], temperature=0, max_tokens=30)[0]
                for p in prompts}  # fmt: skip

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=30, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def main():
        client = make_async_client(openai_gateway, key)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    assert dict(zip(prompts, asyncio.run(main()))) == expected


def test_seeded_sampling_is_reproducible(openai_gateway, model_name):
    client = make_client(openai_gateway, openai_gateway.keys["alpha"])
    kwargs = dict(model=model_name, messages=MESSAGES, temperature=1.0, max_tokens=20, seed=1234)
    assert client.chat.completions.create(**kwargs).choices[0].message.content == (
        client.chat.completions.create(**kwargs).choices[0].message.content
    )


def test_stop_sequence_ends_with_stop(openai_gateway, model_name):
    key = openai_gateway.keys["alpha"]
    full, _ = _ws_answer(openai_gateway, key, MESSAGES, temperature=0, max_tokens=40)
    stop_word = full.split()[3]
    r = make_client(openai_gateway, key).chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0, max_tokens=40, stop=[stop_word]
    )
    assert r.choices[0].finish_reason == "stop"
    assert stop_word not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content)
