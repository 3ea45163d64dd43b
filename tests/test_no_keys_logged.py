"""After real traffic (WebSocket, OpenAI HTTP, SDK, bad keys), no API key is in the logs or the database,
and no prompt is in the logs; every log line is structured."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import httpx
import pytest

from app.logging_setup import JsonFormatter, bind_request_id, redact
from chatgate_sdk import AuthError, Client
from tests.app.harness import ChatClient, GatewayServer

PROMPT = "Zebulon the purple walrus sang"


def _traffic(server: GatewayServer, wrong_key: str) -> None:
    key = server.keys["alpha"]
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "stories260k", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    assert httpx.post(f"{server.base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200 and list(r.iter_lines())
    for bad in (wrong_key, key + "x", key[:-1]):
        r = httpx.post(f"{server.base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {bad}"})
        assert r.status_code == 401

    async def ws_and_sdk():
        client = await ChatClient.connect(server, key)
        await client.chat("a", [{"role": "user", "content": PROMPT}], max_tokens=8)
        await client.close()
        async with Client(server.ws_url, server.keys["local"]) as sdk:
            assert await sdk.complete([{"role": "user", "content": PROMPT}], max_tokens=8)
        with pytest.raises(AuthError):
            async with Client(server.ws_url, wrong_key):
                pass

    asyncio.run(ws_and_sdk())


def test_no_key_in_logs_or_database_and_no_prompt_in_logs(tmp_path, stories_path):
    server = GatewayServer(tmp_path, "stories260k", 256)
    server.start()
    try:
        server.add_tenant("alpha")
        wrong_key = "cg_" + server.keys["alpha"][3:11] + "_" + "W" * 43  # right prefix, wrong secret
        _traffic(server, wrong_key)
    finally:
        server.stop()
    logs = server.logs_without_bootstrap_link()
    database = b"".join(p.read_bytes() for p in tmp_path.glob("chatgate.db*"))
    assert database and "request finished" in logs
    for key in [*server.all_keys, wrong_key]:
        secret = key.split("_", 2)[2]
        assert key not in logs and secret not in logs
        assert key.encode() not in database and secret.encode() not in database
    assert PROMPT not in logs and "walrus" not in logs
    # Structured: every line the logging system wrote is a JSON object; chats carry their request id.
    records = [json.loads(line) for line in server.stderr_path.read_text().splitlines() if line.startswith("{")]
    finished = [r for r in records if r["msg"] == "request finished"]
    assert len(finished) >= 4 and all(r["request_id"] and r["tenant"] for r in finished)


def test_the_formatter_masks_keys_and_carries_the_request_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.no_keys")
    logger.addHandler(handler)
    logger.propagate = False
    key = "cg_abcd1234_" + "s3cr3t-" * 6 + "x"
    bind_request_id("req-42")
    try:
        logger.warning("oops %s / Authorization: Bearer %s", key, "opaque-token")
    finally:
        bind_request_id(None)
        logger.removeHandler(handler)
    record = json.loads(stream.getvalue())
    assert record["request_id"] == "req-42"
    assert "s3cr3t" not in record["msg"] and "opaque-token" not in record["msg"]
    assert "cg_abcd1234" in record["msg"]
    assert redact(f"key={key}") == "key=cg_abcd1234_…"
