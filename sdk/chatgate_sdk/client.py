"""The async client: one WebSocket (``chatgate.v1``) carrying many concurrent chats.

``Client`` owns the connection: it authenticates with ``Authorization: Bearer``,
reads every server event on one reader task and routes it to its chat's
:class:`ChatStream`, and reconnects with exponential backoff (and jitter) when the
connection drops. Chats in flight at a disconnect end with :class:`ConnectionLost`
(the server aborted them); chats started while it reconnects wait for the new
connection. A refused key (close 4401, HTTP 401/403) is final: :class:`AuthError`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from chatgate_sdk.errors import AuthError, ChatgateError, ConnectionLost
from chatgate_sdk.stream import ChatStream

log = logging.getLogger("chatgate_sdk")

PROTOCOL = "chatgate.v1"
CLOSE_UNAUTHORIZED = 4401


class Client:
    """Async chatgate client.

    Args:
        url: the WebSocket endpoint, e.g. ``ws://127.0.0.1:8000/v1/ws`` (an ``http(s)://``
            base URL is accepted and pointed at ``/v1/ws``).
        api_key: the tenant's API key (sent only in the handshake header).
        reconnect: reconnect after a drop; ``False`` leaves the client closed.
        backoff_initial_s, backoff_max_s: the first wait before reconnecting and its cap
            (seconds); each failed attempt doubles the wait, times a random 0.5-1 jitter.
        max_reconnect_attempts: attempts before giving up (``None``: keep trying).
        connect_timeout_s: time for one handshake plus the ``ready`` event.
        chat_wait_s: how long a new chat waits for a connection being re-established.

    Use as ``async with Client(url, key) as c: async for delta in c.chat(messages): ...``.

    Raises (from ``connect``/``__aenter__``):
        AuthError: the key or Origin was refused.
        ConnectionLost: the server could not be reached.
    """

    def __init__(
        self, url: str, api_key: str, *, reconnect: bool = True, backoff_initial_s: float = 0.25,
        backoff_max_s: float = 8.0, max_reconnect_attempts: int | None = 20, connect_timeout_s: float = 10.0,
        chat_wait_s: float = 60.0,
    ) -> None:  # fmt: skip
        self.url = _ws_url(url)
        self._key = api_key
        self.reconnect = reconnect
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.max_reconnect_attempts = max_reconnect_attempts
        self.connect_timeout_s, self.chat_wait_s = connect_timeout_s, chat_wait_s
        self.ready: dict[str, Any] | None = None  # the server's ``ready`` event of the current connection
        self.reconnects = 0  # successful reconnections so far
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        self._chats: dict[str, ChatStream] = {}
        self._ids = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None
        self._closing = False
        self._fatal: ChatgateError | None = None

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection and wait for ``ready``."""
        await self._open()

    async def close(self) -> None:
        """Close the connection (the server aborts its live chats) and stop reconnecting."""
        self._closing = True
        self._fail_all(ConnectionLost("the client was closed"))
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        self._connected.clear()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # ------------------------------------------------------------ chats

    def chat(self, messages: Sequence[dict[str, str]], *, priority: str | None = None, chat_id: str | None = None,
             **params: Any) -> ChatStream:  # fmt: skip
        """A chat to iterate: ``async for delta in client.chat(messages, temperature=0): ...``.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
            priority: ``interactive``, ``standard`` or ``batch`` (default: the tenant's).
            chat_id: the id on the socket (default: a fresh one).
            **params: sampling parameters (``temperature``, ``max_tokens``, ``top_p``, ``stop``,
                ``seed``...; see docs/protocol.md).

        The chat starts on the first iteration (or ``await stream.text()``). Iteration
        yields text deltas and raises a :class:`ChatgateError` subclass on refusal.
        """
        msg = {"type": "chat.create", "id": chat_id or f"c{next(self._ids)}", "messages": list(messages),
               "params": params}  # fmt: skip
        if priority is not None:
            msg["priority"] = priority
        return ChatStream(self, msg)

    async def complete(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> str:
        """The whole answer of one chat (see :meth:`chat`)."""
        return await self.chat(messages, **kwargs).text()

    async def _start(self, stream: ChatStream) -> None:
        """Register the chat and send ``chat.create`` (waiting for a connection if one is being made)."""
        await self._wait_connected()
        if stream.id in self._chats:
            raise ChatgateError(f"chat id {stream.id!r} is already live on this client", "duplicate_id")
        self._chats[stream.id] = stream
        stream.connection = self._ws
        try:
            await self._send(stream.create_message)
        except ChatgateError:
            self._chats.pop(stream.id, None)
            raise

    async def _cancel(self, stream: ChatStream) -> None:
        if self._chats.get(stream.id) is stream and stream.connection is self._ws:
            try:
                await self._send({"type": "chat.cancel", "id": stream.id})
            except ConnectionLost:
                pass  # the drop aborted it anyway

    def _forget(self, stream: ChatStream) -> None:
        if self._chats.get(stream.id) is stream:
            del self._chats[stream.id]

    async def _send(self, obj: dict) -> None:
        ws = self._ws
        if ws is None:
            raise ConnectionLost("not connected")
        try:
            async with self._send_lock:
                await ws.send(json.dumps(obj))
        except ConnectionClosed as exc:
            raise ConnectionLost(f"connection lost while sending: {exc}") from None

    async def _wait_connected(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closing:
            raise ConnectionLost("the client is closed")
        try:
            await asyncio.wait_for(self._connected.wait(), self.chat_wait_s)
        except asyncio.TimeoutError:
            raise ConnectionLost(f"no connection within {self.chat_wait_s:g} s") from None
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------ connection

    async def _open(self) -> None:
        """One handshake plus ``ready``; starts the reader. Raises AuthError or ConnectionLost."""
        try:
            ws = await connect(self.url, additional_headers={"Authorization": f"Bearer {self._key}"},
                               subprotocols=[PROTOCOL], open_timeout=self.connect_timeout_s,
                               max_size=None)  # fmt: skip
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise AuthError(f"the server refused the connection (HTTP {status})", "unauthorized") from None
            raise ConnectionLost(f"handshake failed with HTTP {status}") from None
        except (OSError, InvalidHandshake, asyncio.TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {self.url}: {exc!r}") from None
        try:
            ready = json.loads(await asyncio.wait_for(ws.recv(), self.connect_timeout_s))
        except ConnectionClosed as exc:
            raise _closed_error(exc) from None
        except asyncio.TimeoutError:
            await ws.close()
            raise ConnectionLost("no ready event from the server") from None
        if ready.get("type") != "ready":
            await ws.close()
            raise ConnectionLost(f"expected a ready event, got {ready.get('type')!r}")
        self._ws, self.ready = ws, ready
        self._connected.set()
        self._reader = asyncio.create_task(self._read(ws))

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for frame in ws:
                self._dispatch(json.loads(frame))
        except ConnectionClosed as exc:
            error = _closed_error(exc)
        else:
            error = _closed_error(None, ws)
        if self._closing:
            return
        self._connected.clear()
        self._fail_all(error if isinstance(error, AuthError) else ConnectionLost(f"connection lost: {error}"))
        if isinstance(error, AuthError) or not self.reconnect:
            self._fatal = error if isinstance(error, AuthError) else ConnectionLost("connection lost")
            self._connected.set()  # wake waiters so they see the fatal error
            return
        await self._reconnect()

    async def _reconnect(self) -> None:
        attempt = 0
        while not self._closing:
            wait = min(self.backoff_max_s, self.backoff_initial_s * 2**attempt) * random.uniform(0.5, 1.0)
            await asyncio.sleep(wait)
            attempt += 1
            try:
                await self._open()
                self.reconnects += 1
                log.info("chatgate: reconnected after %d attempt(s)", attempt)
                return
            except AuthError as exc:
                self._fatal = exc
            except ConnectionLost as exc:
                log.info("chatgate: reconnect attempt %d failed: %s", attempt, exc)
                if self.max_reconnect_attempts is None or attempt < self.max_reconnect_attempts:
                    continue
                self._fatal = ConnectionLost(f"gave up reconnecting after {attempt} attempts: {exc}")
            self._connected.set()  # wake waiters so they see the fatal error
            return

    def _dispatch(self, event: dict) -> None:
        chat_id = event.get("id")
        stream = self._chats.get(chat_id) if chat_id is not None else None
        if stream is None:
            if event.get("type") == "error":
                log.warning("chatgate: error event for no live chat: %s", event.get("message"))
            return
        if event.get("type") in ("chat.done", "error"):
            del self._chats[chat_id]
        stream.deliver(event)

    def _fail_all(self, error: ChatgateError) -> None:
        chats, self._chats = self._chats, {}
        for stream in chats.values():
            stream.deliver(error)


def _closed_error(exc: ConnectionClosed | None, ws: ClientConnection | None = None) -> ChatgateError:
    frame = exc.rcvd if exc is not None else (ws.close_code if ws is not None else None)
    code = frame.code if hasattr(frame, "code") else frame
    reason = getattr(frame, "reason", "") if frame is not None else ""
    if code == CLOSE_UNAUTHORIZED:
        return AuthError(reason or "invalid API key", "unauthorized")
    return ConnectionLost(f"closed with code {code} {reason}".strip())


def _ws_url(url: str) -> str:
    if url.startswith(("http://", "https://")):
        url = "ws" + url[4:]
        return url.rstrip("/") + "/v1/ws" if not url.rstrip("/").endswith("/v1/ws") else url
    return url
