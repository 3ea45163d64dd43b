"""Authentication and Origin: refused sockets get a clear code and reason; no key is ever logged."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.app.harness import GatewayServer

WRONG_KEY = "cg_zzzzzzzz_ThisIsNotAValidKeyAtAllButLooksLikeOne0000000000"


async def _open(gateway: GatewayServer, *, key: str | None = None, via: str = "header", origin: str | None = None,
                first: dict | None = None) -> dict:  # fmt: skip
    """Connect, optionally send a first frame, and report the first event or the close."""
    headers = {"Authorization": f"Bearer {key}"} if key and via == "header" else {}
    protocols = ["chatgate.v1"] + ([f"chatgate.bearer.{key}"] if key and via == "subprotocol" else [])
    async with websockets.connect(
        gateway.ws_url, additional_headers=headers, subprotocols=protocols, origin=origin
    ) as ws:
        if first is not None:
            await ws.send(json.dumps(first))
        try:
            event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            return {"event": event, "subprotocol": ws.subprotocol}
        except websockets.ConnectionClosed as exc:
            return {"close_code": exc.rcvd.code, "close_reason": exc.rcvd.reason}


def _refused(result: dict, reason_words: str) -> None:
    assert result.get("close_code") == 4401, result
    assert reason_words in result["close_reason"], result


@pytest.mark.parametrize("via", ["header", "subprotocol", "message"])
def test_valid_key_is_accepted_by_every_method(gateway: GatewayServer, via: str):
    key = gateway.keys["alpha"]
    if via == "message":
        result = asyncio.run(_open(gateway, first={"type": "auth", "api_key": key}))
    else:
        result = asyncio.run(_open(gateway, key=key, via=via))
    assert result["event"]["type"] == "ready" and result["event"]["tenant"] == "alpha"
    assert result["subprotocol"] == "chatgate.v1"  # never the bearer subprotocol


def test_no_key_times_out_with_4401(gateway: GatewayServer):
    _refused(asyncio.run(_open(gateway)), "timed out")


def test_first_message_other_than_auth_is_refused(gateway: GatewayServer):
    first = {"type": "chat.create", "id": "a", "messages": [{"role": "user", "content": "hi"}]}
    _refused(asyncio.run(_open(gateway, first=first)), "authentication required")


@pytest.mark.parametrize("via", ["header", "subprotocol", "message"])
def test_wrong_key_is_refused(gateway: GatewayServer, via: str):
    if via == "message":
        result = asyncio.run(_open(gateway, first={"type": "auth", "api_key": WRONG_KEY}))
    else:
        result = asyncio.run(_open(gateway, key=WRONG_KEY, via=via))
    _refused(result, "invalid API key")


def test_revoked_key_is_refused(gateway: GatewayServer):
    prefix, key = gateway.add_key("alpha")
    assert asyncio.run(_open(gateway, key=key))["event"]["type"] == "ready"
    gateway.run_store(lambda store: store.revoke_key(prefix))
    _refused(asyncio.run(_open(gateway, key=key)), "invalid API key")


def test_disabled_tenant_is_refused(gateway: GatewayServer):
    key = gateway.add_tenant("gamma")
    assert asyncio.run(_open(gateway, key=key))["event"]["type"] == "ready"
    gateway.run_store(lambda store: store.set_disabled("gamma", True))
    _refused(asyncio.run(_open(gateway, key=key)), "invalid API key")


def test_foreign_origin_is_refused_before_the_socket_opens(gateway: GatewayServer):
    with pytest.raises(websockets.InvalidStatus) as info:
        asyncio.run(_open(gateway, key=gateway.keys["alpha"], origin="http://evil.example"))
    assert info.value.response.status_code == 403
    assert b"origin_forbidden" in info.value.response.body


def test_own_and_listed_origins_are_allowed(gateway: GatewayServer):
    for origin in (f"http://127.0.0.1:{gateway.port}", f"http://localhost:{gateway.port}"):
        result = asyncio.run(_open(gateway, key=gateway.keys["alpha"], origin=origin))
        assert result["event"]["type"] == "ready", origin


def test_the_server_log_contains_no_key(gateway: GatewayServer):
    # Runs after the tests above in this module; they presented every kind of key.
    logs = gateway.logs_without_bootstrap_link()
    assert "socket" in logs and "refused" in logs  # the gateway does log its sockets
    for key in [*gateway.all_keys, WRONG_KEY]:
        secret = key.split("_", 2)[-1]
        assert key not in logs and secret not in logs
    # The bootstrap link was printed exactly once, on stdout.
    assert gateway.logs().count("#key=") == 1
