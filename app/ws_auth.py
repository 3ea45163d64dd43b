"""WebSocket authentication for ``/v1/ws``: the Origin check and where the API key comes from.

The key is read from ``Authorization: Bearer KEY``, from a ``chatgate.bearer.KEY``
subprotocol, or from a first ``{"type": "auth", "api_key": KEY}`` message within a
time limit (browsers cannot set headers). Nothing here logs a key.
"""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocket

from app.protocol import BEARER_SUBPROTOCOL_PREFIX, AuthMessage, ProtocolError, parse_client_message

CLOSE_UNAUTHORIZED = 4401  # no key, bad key, revoked key, disabled tenant, auth timeout
MAX_AUTH_MESSAGE_BYTES = 4096


def origin_allowed(websocket: WebSocket, allowed: list[str] | tuple[str, ...] | str) -> bool:
    """True for no ``Origin`` (not a browser), ``*``, a listed origin, or the page's own origin."""
    origin = websocket.headers.get("origin")
    if origin is None:
        return True
    if isinstance(allowed, str):
        allowed = [o.strip() for o in allowed.split(",") if o.strip()]
    origin = origin.rstrip("/").lower()
    if "*" in allowed or origin in {o.rstrip("/").lower() for o in allowed}:
        return True
    host = websocket.headers.get("host", "").lower()
    return bool(host) and origin in (f"http://{host}", f"https://{host}")


def key_from_handshake(websocket: WebSocket) -> str | None:
    """The key from ``Authorization: Bearer KEY`` or a ``chatgate.bearer.KEY`` subprotocol."""
    scheme, _, value = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    for proto in websocket.scope.get("subprotocols") or []:
        if proto.startswith(BEARER_SUBPROTOCOL_PREFIX) and len(proto) > len(BEARER_SUBPROTOCOL_PREFIX):
            return proto[len(BEARER_SUBPROTOCOL_PREFIX) :]
    return None


async def receive_auth_key(websocket: WebSocket, timeout_s: float) -> str | None:
    """Wait for the first frame, which must be an ``auth`` message; close 4401 otherwise."""
    try:
        message = await asyncio.wait_for(websocket.receive(), timeout_s)
    except asyncio.TimeoutError:
        await close(websocket, CLOSE_UNAUTHORIZED, f"authentication timed out after {timeout_s:g} s")
        return None
    if message["type"] == "websocket.disconnect":
        return None
    raw = message.get("text") if message.get("text") is not None else (message.get("bytes") or b"").decode(
        "utf-8", "replace"
    )
    if len(raw) <= MAX_AUTH_MESSAGE_BYTES:
        try:
            parsed = parse_client_message(json.loads(raw))
            if isinstance(parsed, AuthMessage):
                return parsed.api_key
        except (ValueError, ProtocolError):
            pass
    await close(websocket, CLOSE_UNAUTHORIZED, 'authentication required: send {"type": "auth", "api_key": KEY} first')
    return None


async def close(websocket: WebSocket, code: int, reason: str) -> None:
    """Close with ``code`` and ``reason``; a socket the peer already closed is fine."""
    try:
        await websocket.close(code=code, reason=reason)
    except (RuntimeError, OSError):
        pass  # already closed by the peer
