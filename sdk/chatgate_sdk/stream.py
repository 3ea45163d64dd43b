"""One chat on a shared connection: an async iterator of text deltas."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatgate_sdk.errors import ChatgateError, error_from_event

if TYPE_CHECKING:
    from chatgate_sdk.client import Client


@dataclass(frozen=True)
class ChatResult:
    """How a chat ended (the server's ``chat.done``).

    Attributes:
        finish_reason: ``stop``, ``length`` or ``abort`` (cancelled).
        prompt_tokens, completion_tokens: the usage charged.
        ttft_ms: time to first token on the server; ``tokens_per_s``: decode rate (either may be None).
    """

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    tokens_per_s: float | None

    @classmethod
    def from_event(cls, event: dict) -> ChatResult:
        usage, timings = event.get("usage") or {}, event.get("timings") or {}
        return cls(event["finish_reason"], usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                   timings.get("ttft_ms"), timings.get("tokens_per_s"))  # fmt: skip


class ChatStream:
    """``async for delta in stream`` yields the answer's text as it is generated.

    The chat starts on the first iteration. After the loop, :attr:`result` holds the
    :class:`ChatResult`. :meth:`cancel` stops it on the server (the loop then ends,
    ``result.finish_reason == "abort"``). To leave the loop early, use the stream as
    an async context manager (``async with client.chat(...) as stream``) or call
    :meth:`aclose`: either cancels a chat still running. Refusals and drops raise
    :class:`chatgate_sdk.ChatgateError` subclasses.
    """

    def __init__(self, client: Client, create_message: dict) -> None:
        self._client = client
        self.create_message = create_message
        self.id: str = create_message["id"]
        self.result: ChatResult | None = None
        self.connection: Any = None  # the socket it runs on (a cancel after a reconnect is moot)
        self._events: asyncio.Queue = asyncio.Queue()
        self._started = False
        self._finished = False

    def __aiter__(self) -> ChatStream:
        return self

    async def __aenter__(self) -> ChatStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __anext__(self) -> str:
        if self._finished:
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            try:
                await self._client._start(self)
            except BaseException:
                self._finished = True
                raise
        while True:
            event = await self._events.get()
            if isinstance(event, ChatgateError):
                self._finished = True
                raise event
            kind = event.get("type")
            if kind == "chat.delta":
                if event["text"]:
                    return event["text"]
            elif kind == "chat.done":
                self._finished = True
                self.result = ChatResult.from_event(event)
                raise StopAsyncIteration
            elif kind == "error":
                self._finished = True
                raise error_from_event(event)

    def deliver(self, event: dict | ChatgateError) -> None:
        """Called by the client's reader (events of this chat, or the error that ended it)."""
        self._events.put_nowait(event)

    async def cancel(self) -> None:
        """Ask the server to stop this chat; iteration ends once its ``chat.done`` arrives."""
        if self._started and not self._finished:
            await self._client._cancel(self)

    async def aclose(self) -> None:
        """Stop listening; a chat still running is cancelled on the server."""
        if self._started and not self._finished:
            self._finished = True
            await self._client._cancel(self)
            self._client._forget(self)

    async def text(self) -> str:
        """The whole answer (iterates the stream to its end)."""
        return "".join([delta async for delta in self])
