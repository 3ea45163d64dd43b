"""Every bad input gets an ``error`` event naming the problem; the same socket then chats fine."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.app.harness import ChatClient, GatewayServer

HI = [{"role": "user", "content": "Tom had a ball"}]


def _create(chat_id: str = "x", **fields) -> dict:
    return {"type": "chat.create", "id": chat_id, "messages": HI, **fields}


CASES = {
    # name: (frame, expected code, words the message must contain)
    "malformed_json": ('{"type": "chat.create", "id": ', "invalid_json", "malformed JSON"),
    "not_an_object": ("[1, 2]", "invalid_message", "JSON object"),
    "unknown_type": ({"type": "chat.explode", "id": "x"}, "unknown_type", "chat.explode"),
    "missing_type": ({"id": "x"}, "invalid_message", "'type'"),
    "missing_id": ({"type": "chat.create", "messages": HI}, "invalid_message", "'id' is required"),
    "temperature_out_of_range": (_create(params={"temperature": 5}), "invalid_params", "params.temperature"),
    "top_p_zero": (_create(params={"top_p": 0}), "invalid_params", "params.top_p"),
    "max_tokens_zero": (_create(params={"max_tokens": 0}), "invalid_params", "params.max_tokens"),
    "unknown_param": (_create(params={"temprature": 1}), "invalid_params", "unknown field 'params.temprature'"),
    "empty_messages": (_create(messages=[]), "invalid_message", "messages"),
    "bad_role": (_create(messages=[{"role": "robot", "content": "x"}]), "invalid_message", "role"),
    "prompt_over_max_length": (
        _create(messages=[{"role": "user", "content": "Tom had a big red ball. " * 120}]),
        "prompt_too_long", "tokens",
    ),
    "oversize_frame": (_create(messages=[{"role": "user", "content": "a" * 70_000}]), "message_too_large", "65536"),
    "cancel_unknown_id": ({"type": "chat.cancel", "id": "nope"}, "unknown_id", "nope"),
    "auth_again": ({"type": "auth", "api_key": "cg_whatever"}, "already_authenticated", "already"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_message_gets_an_error_and_the_socket_stays_usable(gateway: GatewayServer, case: str):
    frame, code, words = CASES[case]

    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["alpha"])
        await client.send(frame if isinstance(frame, str) else json.dumps(frame))
        # An oversize frame is refused unread, so its error carries no chat id.
        named = isinstance(frame, dict) and "id" in frame and code != "message_too_large"
        chat_id = frame["id"] if named else None
        err = await client.next_event(chat_id, timeout=30)
        text, done = await client.chat("ok", HI, temperature=0, max_tokens=5)
        await client.close()
        return err, done

    err, done = asyncio.run(main())
    assert err["type"] == "error" and err["code"] == code, err
    assert words in err["message"], err
    assert done["type"] == "chat.done" and done["usage"]["completion_tokens"] == 5


def test_duplicate_active_id_is_refused_and_the_first_chat_goes_on(gateway: GatewayServer):
    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["alpha"])
        await client.create("dup", HI, temperature=0, max_tokens=200)
        await client.create("dup", HI, temperature=0, max_tokens=3)
        events = []
        while not events or events[-1]["type"] == "chat.delta" or events[-1]["type"] == "error":
            events.append(await client.next_event("dup"))
        _, after = await client.chat("after", HI, temperature=0, max_tokens=2)
        await client.close()
        return events, after

    events, after = asyncio.run(main())
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "duplicate_id" and "'dup'" in errors[0]["message"]
    assert events[-1]["type"] == "chat.done" and events[-1]["usage"]["completion_tokens"] > 3
    assert after["type"] == "chat.done"


def test_frame_far_over_the_limit_closes_with_1009(gateway: GatewayServer):
    import websockets

    async def main():
        client = await ChatClient.connect(gateway, gateway.keys["alpha"])
        await client.send("x" * (4 * 65536 + 10))
        await asyncio.wait_for(client._reader, 10)
        return client.ws.close_code

    try:
        code = asyncio.run(main())
    except websockets.ConnectionClosed as exc:  # pragma: no cover - depends on timing
        code = exc.rcvd.code
    assert code == 1009
