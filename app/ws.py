"""The ``/v1/ws`` chat endpoint: authentication, then many concurrent chats per socket.

Flow of one socket (``docs/protocol.md`` is the client-facing contract):

1. Handshake: a foreign ``Origin`` is refused with HTTP 403 before ``accept``.
   ``chatgate.v1`` is echoed as the subprotocol when offered.
2. Authentication: the key from ``Authorization: Bearer``, from a
   ``chatgate.bearer.KEY`` subprotocol, or from a first ``auth`` message within
   ``auth_timeout_s``. Failure closes the socket with 4401 (or 1013 when the store
   is down). Keys are never logged.
3. Session: a ``ready`` event, then a reader loop that validates client messages
   and starts one task per chat; each task streams engine outputs as events into a
   bounded send queue that one writer task drains. A full queue (a client that
   reads too slowly) closes the socket with 1008. Cancel and disconnect abort the
   chats in the engine at once, which frees their KV blocks.

The per-token path touches no database: the principal is resolved once per socket.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from app.protocol import (
    PRIORITY_LEVELS,
    PROTOCOL_VERSION,
    AuthMessage,
    ChatCancel,
    ChatCreate,
    ChatDeltaEvent,
    ChatDoneEvent,
    ErrorEvent,
    Ping,
    PongEvent,
    ProtocolError,
    QuotaErrorEvent,
    ReadyEvent,
    Timings,
    Usage,
    dump_event,
    parse_client_message,
)
from app.ws_auth import CLOSE_UNAUTHORIZED, close as _close, key_from_handshake, origin_allowed
from app.ws_auth import receive_auth_key as _receive_auth_key
from app.chat_service import ChatService, PriorityNotAllowedError, QuotaExceededError, default_priority
from engine import InvalidRequestError, SamplingParams
from engine.errors import EngineDeadError
from tenancy.errors import StoreUnavailableError

log = logging.getLogger("chatgate.ws")

# Close codes (see docs/protocol.md).
CLOSE_POLICY = 1008  # send queue overflow: the client reads too slowly
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN = 1013  # the tenancy store is unavailable

MAX_CHATS_PER_SOCKET = 64

_socket_ids = itertools.count(1)


async def websocket_endpoint(websocket: WebSocket) -> None:
    """ASGI handler of ``/v1/ws``; the app state holds ``llm``, ``store`` and ``settings``."""
    state = websocket.app.state
    if not origin_allowed(websocket, state.settings.allowed_origins):
        log.warning("refused websocket from origin %r", websocket.headers.get("origin"))
        await _deny(websocket, 403, "origin_forbidden", "this Origin is not in the allow-list")
        return
    offered = websocket.scope.get("subprotocols") or []
    key = key_from_handshake(websocket)
    await websocket.accept(subprotocol=PROTOCOL_VERSION if PROTOCOL_VERSION in offered else None)
    if key is None:
        key = await _receive_auth_key(websocket, state.settings.auth_timeout_s)
        if key is None:
            return
    try:
        principal = await state.store.authenticate(key)
    except StoreUnavailableError:
        log.error("websocket auth failed: tenancy store unavailable")
        await _close(websocket, CLOSE_TRY_AGAIN, "authentication store unavailable, try again later")
        return
    if principal is None:
        log.info("websocket refused: invalid, revoked or disabled API key (client %s)", _client(websocket))
        await _close(websocket, CLOSE_UNAUTHORIZED, "invalid API key (unknown, revoked, or tenant disabled)")
        return
    await ChatSession(websocket, state.llm, principal, state.settings, state.chat_service).run()


class ChatSession:
    """One authenticated socket: its live chats, its bounded send queue and its writer.

    Args:
        websocket: an accepted socket.
        llm: the engine client (``engine.AsyncLLM``).
        principal: who the socket acts for (``tenancy.records.Principal``).
        settings: ``app.settings.Settings`` (``ws_max_message_bytes``, ``ws_send_queue_size``).
        service: the ``ChatService`` every chat runs through (priority check, quota
            reservation and settlement); ``None`` runs unmetered (transport tests).
    """

    def __init__(
        self, websocket: WebSocket, llm: Any, principal: Any, settings: Any, service: ChatService | None = None
    ) -> None:
        self._ws = websocket
        self._llm = llm
        self._service = service if service is not None else ChatService(llm, None, settings)
        self._principal = principal
        self._max_bytes = settings.ws_max_message_bytes
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=settings.ws_send_queue_size)
        self._overflow = asyncio.Event()
        self._chats: dict[str, asyncio.Task] = {}
        self._sid = next(_socket_ids)
        self._request_ids = itertools.count(1)
        self._default_priority = default_priority(principal)

    async def run(self) -> None:
        """Serve the socket until the client leaves or overflows its send queue."""
        p = self._principal
        log.info("socket %d open: tenant %s key %s…", self._sid, p.tenant_name, p.key_prefix)
        self._emit(self._ready_event())
        tasks = [
            asyncio.create_task(self._reader()),
            asyncio.create_task(self._writer()),
            asyncio.create_task(self._overflow.wait()),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await self._cancel_all()
            if self._overflow.is_set():
                log.warning("socket %d closed: send queue full (slow reader)", self._sid)
                await _close(self._ws, CLOSE_POLICY, "send queue full: the client reads too slowly")
            log.info("socket %d closed", self._sid)

    def _ready_event(self) -> ReadyEvent:
        allowed = self._principal.allowed_priorities
        return ReadyEvent(
            tenant=self._principal.tenant_name,
            key_prefix=self._principal.key_prefix,
            model=self._llm.model_name,
            max_model_len=self._llm.max_model_len,
            priorities=sorted(allowed, key=PRIORITY_LEVELS.__getitem__),
            default_priority=self._default_priority,
            max_message_bytes=self._max_bytes,
            max_chats=MAX_CHATS_PER_SOCKET,
        )

    # ------------------------------------------------------------ sending

    def _emit(self, event: Any) -> None:
        """Queue one event; a full queue marks the socket for closing (never blocks, never grows)."""
        if self._overflow.is_set():
            return
        try:
            self._queue.put_nowait(dump_event(event))
        except asyncio.QueueFull:
            self._overflow.set()

    async def _writer(self) -> None:
        while True:
            text = await self._queue.get()
            try:
                await self._ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                return  # the client is gone; run() cleans up

    # ------------------------------------------------------------ receiving

    async def _reader(self) -> None:
        while True:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                self._handle_frame(message)
            except ProtocolError as exc:
                self._emit(ErrorEvent(id=exc.chat_id, code=exc.code, message=exc.message))

    def _handle_frame(self, message: dict) -> None:
        text, data = message.get("text"), message.get("bytes")
        size = len(data) if text is None else len(text.encode("utf-8"))
        if size > self._max_bytes:
            raise ProtocolError(
                "message_too_large", f"message is {size} bytes; the limit is {self._max_bytes} bytes"
            )
        try:
            raw = json.loads(text if text is not None else (data or b""))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError("invalid_json", f"malformed JSON: {exc}") from None
        msg = parse_client_message(raw)
        if isinstance(msg, ChatCreate):
            self._start_chat(msg)
        elif isinstance(msg, ChatCancel):
            self._cancel_chat(msg.id)
        elif isinstance(msg, Ping):
            self._emit(PongEvent(data=msg.data))
        else:  # AuthMessage
            raise ProtocolError("already_authenticated", "this socket is already authenticated")

    # ------------------------------------------------------------ chats

    def _start_chat(self, msg: ChatCreate) -> None:
        if msg.id in self._chats:
            raise ProtocolError("duplicate_id", f"chat id {msg.id!r} is already active on this socket", msg.id)
        if len(self._chats) >= MAX_CHATS_PER_SOCKET:
            raise ProtocolError(
                "too_many_chats", f"at most {MAX_CHATS_PER_SOCKET} chats may run at once on one socket", msg.id
            )
        try:
            priority = self._service.check_priority(self._principal, msg.priority)
        except PriorityNotAllowedError as exc:
            raise ProtocolError("forbidden_priority", str(exc), msg.id) from None
        prompt_ids, params = self._prepare(msg)
        request_id = f"ws{self._sid}-{next(self._request_ids)}"
        task = asyncio.create_task(self._run_chat(msg.id, request_id, prompt_ids, params, priority))
        task.add_done_callback(lambda t: self._on_chat_task_done(msg.id, t, len(prompt_ids)))
        self._chats[msg.id] = task

    def _on_chat_task_done(self, chat_id: str, task: asyncio.Task, prompt_tokens: int) -> None:
        # A task cancelled before its first step never ran _run_chat (nothing reached the
        # engine): free its id and still answer with a chat.done, as for any cancel.
        if self._chats.get(chat_id) is task:
            del self._chats[chat_id]
            self._emit(_done_event(chat_id, prompt_tokens, None, "abort"))

    def _prepare(self, msg: ChatCreate) -> tuple[list[int], SamplingParams]:
        """Tokenize the conversation and build sampling params; errors name the problem."""
        messages = [m.model_dump() for m in msg.messages]
        try:
            prompt_ids = self._llm.apply_chat_template(messages)
        except InvalidRequestError as exc:
            raise ProtocolError(getattr(exc, "code", "invalid_request"), str(exc), msg.id) from None
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects the role order
            raise ProtocolError("invalid_message", f"the chat template refused the messages: {exc}", msg.id) from None
        room = self._llm.max_model_len - len(prompt_ids)
        if room < 1:
            raise ProtocolError(
                "prompt_too_long",
                f"prompt is {len(prompt_ids)} tokens; the model's context holds {self._llm.max_model_len} "
                "tokens and at least one must be left for the answer",
                msg.id,
            )
        p = msg.params
        try:
            params = SamplingParams(
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                max_tokens=min(p.max_tokens, room), stop=p.stop, seed=p.seed,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty,
            )  # fmt: skip
        except InvalidRequestError as exc:
            raise ProtocolError("invalid_params", str(exc), msg.id) from None
        return prompt_ids, params

    def _cancel_chat(self, chat_id: str) -> None:
        task = self._chats.get(chat_id)
        if task is None:
            raise ProtocolError("unknown_id", f"no active chat with id {chat_id!r} (already finished?)", chat_id)
        if not task.cancelling():
            task.cancel()

    async def _cancel_all(self) -> None:
        tasks = list(self._chats.values())
        for task in tasks:
            if not task.cancelling():  # a second cancel would interrupt the engine abort
                task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_chat(
        self, chat_id: str, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: str
    ) -> None:
        """Stream one chat through the chat service: deltas as they come, then exactly one
        ``chat.done`` or ``error`` (a quota refusal is a ``quota_exceeded`` error)."""
        stream = self._service.run(self._principal, request_id, prompt_ids, params, priority)
        last = None
        done: ChatDoneEvent | ErrorEvent | None = None
        try:
            async for out in stream:
                last = out
                delta = out.outputs[0].delta_text
                if delta:
                    self._emit(ChatDeltaEvent(id=chat_id, text=delta))
            if last is not None and last.outputs[0].finish_reason == "error":
                log.error("socket %d chat %s failed in the engine: %s", self._sid, request_id, last.error)
                done = ErrorEvent(id=chat_id, code="engine_error", message="the engine failed on this chat")
            else:
                done = _done_event(chat_id, len(prompt_ids), last, None)
        except asyncio.CancelledError:
            # chat.cancel or disconnect; closing the stream below aborts it in the engine.
            done = _done_event(chat_id, len(prompt_ids), last, "abort")
        except QuotaExceededError as exc:
            done = _quota_error(chat_id, exc)
        except PriorityNotAllowedError as exc:
            done = ErrorEvent(id=chat_id, code="forbidden_priority", message=str(exc))
        except StoreUnavailableError:
            log.error("socket %d chat %s refused: tenancy store unavailable", self._sid, request_id)
            done = ErrorEvent(id=chat_id, code="store_unavailable",
                              message="the quota store is unavailable; try again later")  # fmt: skip
        except InvalidRequestError as exc:
            done = ErrorEvent(id=chat_id, code=getattr(exc, "code", "invalid_request"), message=str(exc))
        except EngineDeadError as exc:
            log.error("socket %d chat %s: the engine has stopped: %s", self._sid, request_id, exc)
            done = ErrorEvent(id=chat_id, code="engine_unavailable",
                              message="the engine has stopped; no chat can run until the service restarts")
        except Exception:
            log.exception("socket %d chat %s failed in the engine", self._sid, request_id)
            done = ErrorEvent(id=chat_id, code="engine_error", message="the engine failed on this chat")
        finally:
            await stream.aclose()  # the service aborts the request in the engine and settles its quota
            # Free the id before the client can learn the chat ended, so it may reuse it at once.
            self._chats.pop(chat_id, None)
            if done is not None:
                self._emit(done)


def _quota_error(chat_id: str, exc: QuotaExceededError) -> QuotaErrorEvent:
    retry_ms = None if exc.retry_after_s is None else int(exc.retry_after_s * 1000) + 1
    return QuotaErrorEvent(id=chat_id, message=str(exc), quota=exc.quota_name, limit=exc.limit,
                           retry_after_ms=retry_ms, retryable=exc.retryable)  # fmt: skip


def _done_event(chat_id: str, prompt_tokens: int, out: Any, finish_reason: str | None) -> ChatDoneEvent:
    completion = out.outputs[0] if out is not None else None
    n = len(completion.token_ids) if completion is not None else 0
    reason = finish_reason or (completion.finish_reason if completion is not None else None) or "abort"
    return ChatDoneEvent(
        id=chat_id,
        finish_reason=reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=n),
        timings=_timings(getattr(out, "metrics", None), n),
    )


def _timings(metrics: Any, num_tokens: int) -> Timings:
    """TTFT from arrival; decode rate over the tokens after the first (all tokens if only one)."""
    arrival = getattr(metrics, "arrival_time", None)
    first = getattr(metrics, "first_token_time", None)
    finished = getattr(metrics, "finished_time", None)
    ttft_ms = (first - arrival) * 1000.0 if arrival is not None and first is not None else None
    rate = None
    if first is not None and finished is not None and num_tokens > 1 and finished > first:
        rate = (num_tokens - 1) / (finished - first)
    elif arrival is not None and finished is not None and num_tokens >= 1 and finished > arrival:
        rate = num_tokens / (finished - arrival)
    return Timings(
        ttft_ms=round(ttft_ms, 2) if ttft_ms is not None else None,
        tokens_per_s=round(rate, 2) if rate is not None else None,
    )


async def _deny(websocket: WebSocket, status: int, code: str, message: str) -> None:
    """Refuse the handshake with an HTTP answer (or a plain 403 where the server cannot send one)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse({"error": {"code": code, "message": message}}, status))
    else:
        await websocket.close(code=CLOSE_POLICY, reason=message)


def _client(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else "?"
