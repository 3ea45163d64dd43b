"""The ``/v1/ws`` wire protocol: pydantic models of every client message and server event.

Every frame is one JSON object with a ``type`` field. Client messages are parsed
through :data:`CLIENT_MESSAGE` (a union discriminated on ``type``); server events
are built from the ``*Event`` models and serialized with :func:`dump_event`.
``docs/protocol.md`` is the prose version of this file; keep them in step.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = "chatgate.v1"
# Subprotocol prefix that carries a key from clients that cannot set headers.
BEARER_SUBPROTOCOL_PREFIX = "chatgate.bearer."

# Priority class names, most urgent first, and the engine's integer for each.
PRIORITY_LEVELS: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}
Priority = Literal["interactive", "standard", "batch"]

# A chat id is chosen by the client; it only has to be unique among that socket's live chats.
ChatId = Annotated[str, Field(min_length=1, max_length=128)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- client messages


class ChatMessage(_Message):
    """One turn of a conversation."""

    role: Literal["system", "user", "assistant"]
    content: str


class ChatParams(_Message):
    """Sampling parameters (vLLM/OpenAI meanings); every field is optional.

    ``max_tokens`` is capped by the server to the room left in the model's
    context window after the prompt (the chat then ends with ``"length"``).
    """

    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1, le=32768)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(None, max_length=8)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)


class AuthMessage(_Message):
    """First message of a browser socket that carried no key in its handshake."""

    type: Literal["auth"]
    api_key: str = Field(min_length=1, max_length=512)


class ChatCreate(_Message):
    """Start a chat; the answer streams back as ``chat.delta`` events then one ``chat.done``."""

    type: Literal["chat.create"]
    id: ChatId
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    params: ChatParams = ChatParams()
    priority: Priority | None = None


class ChatCancel(_Message):
    """Stop a live chat; the server answers with its ``chat.done`` (``finish_reason: "abort"``)."""

    type: Literal["chat.cancel"]
    id: ChatId


class Ping(_Message):
    """Liveness probe; answered by ``pong`` carrying the same ``data``."""

    type: Literal["ping"]
    data: Any = None


ClientMessage = Annotated[
    Union[AuthMessage, ChatCreate, ChatCancel, Ping], Field(discriminator="type")
]
CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)

# ---------------------------------------------------------------- server events


class ReadyEvent(_Message):
    """Sent once, right after the socket is authenticated; chats may be sent before it arrives
    only on sockets authenticated in the handshake."""

    type: Literal["ready"] = "ready"
    protocol: str = PROTOCOL_VERSION
    tenant: str
    key_prefix: str
    model: str
    max_model_len: int
    priorities: list[Priority]
    default_priority: Priority
    max_message_bytes: int
    max_chats: int


class ChatDeltaEvent(_Message):
    type: Literal["chat.delta"] = "chat.delta"
    id: str
    text: str


class Usage(_Message):
    prompt_tokens: int
    completion_tokens: int


class Timings(_Message):
    """``ttft_ms``: arrival to first token; ``tokens_per_s``: decode rate after the first token."""

    ttft_ms: float | None
    tokens_per_s: float | None


class ChatDoneEvent(_Message):
    type: Literal["chat.done"] = "chat.done"
    id: str
    finish_reason: Literal["stop", "length", "abort"]
    usage: Usage
    timings: Timings


class ErrorEvent(_Message):
    """A problem with one message or chat; the socket stays open (unless a close frame follows)."""

    type: Literal["error"] = "error"
    id: str | None = None
    code: str
    message: str


class QuotaErrorEvent(ErrorEvent):
    """A chat refused by a quota (``code: "quota_exceeded"``): which quota, its limit, and
    when to retry (``retry_after_ms`` is null when waiting does not help;
    ``retryable`` is false for a used-up day/month budget and for a request larger
    than the limit)."""

    code: Literal["quota_exceeded"] = "quota_exceeded"
    quota: str
    limit: int
    retry_after_ms: int | None
    retryable: bool


class PongEvent(_Message):
    type: Literal["pong"] = "pong"
    data: Any = None


def dump_event(event: _Message) -> str:
    """Serialize a server event to its JSON text frame."""
    return event.model_dump_json()


# ---------------------------------------------------------------- parse errors


class ProtocolError(Exception):
    """A client frame that cannot be acted on; becomes an ``error`` event.

    ``chat_id`` is set when the frame named a chat, so the client can match the error.
    """

    def __init__(self, code: str, message: str, chat_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.chat_id = chat_id


def parse_client_message(raw: Any) -> ClientMessage:
    """Validate one decoded JSON value as a client message.

    Raises:
        ProtocolError: ``invalid_message`` (not an object, no ``type``, missing or
            wrong fields: the message lists each offending field), ``unknown_type``,
            or ``invalid_params`` (a ``params`` field out of range).
    """
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_message", f"a message must be a JSON object, got {_json_kind(raw)}")
    chat_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    try:
        return CLIENT_MESSAGE.validate_python(raw)
    except ValidationError as exc:
        raise _protocol_error(exc, raw, chat_id) from None


def _protocol_error(exc: ValidationError, raw: dict, chat_id: str | None) -> ProtocolError:
    errors = exc.errors(include_url=False, include_input=False)
    kinds = {e["type"] for e in errors}
    if "union_tag_not_found" in kinds:
        return ProtocolError("invalid_message", "missing field 'type'", chat_id)
    if "union_tag_invalid" in kinds:
        known = ", ".join(repr(t) for t in ("auth", "chat.create", "chat.cancel", "ping"))
        return ProtocolError(
            "unknown_type", f"unknown message type {raw.get('type')!r}; expected one of {known}", chat_id
        )
    # Drop the union-member name pydantic puts first (e.g. 'chat.create').
    parts = [_describe(e) for e in errors]
    code = "invalid_params" if all(_field_path(e)[:1] == ["params"] for e in errors) else "invalid_message"
    return ProtocolError(code, f"{raw.get('type')}: " + "; ".join(parts), chat_id)


def _field_path(error: dict) -> list[str]:
    return [str(p) for p in error["loc"][1:]]


def _describe(error: dict) -> str:
    path = ".".join(_field_path(error)) or "message"
    if error["type"] == "missing":
        return f"field '{path}' is required"
    if error["type"] == "extra_forbidden":
        return f"unknown field '{path}'"
    return f"'{path}': {error['msg']}"


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
