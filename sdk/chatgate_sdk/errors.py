"""Typed errors of the chatgate SDK; every one is a :class:`ChatgateError`."""

from __future__ import annotations


class ChatgateError(Exception):
    """Base class. ``code`` is the server's machine-readable reason, when it gave one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class AuthError(ChatgateError):
    """The key was refused (unknown, revoked, tenant disabled; close 4401) or the Origin was (HTTP 403).

    Not retried: a new connection with the same key would be refused again.
    """


class QuotaExceeded(ChatgateError):
    """A tenant quota refused the chat before the engine saw it.

    Attributes:
        quota: which limit (``requests_per_minute``, ``tokens_per_minute``,
            ``max_concurrent_chats``, ``tokens_per_day``, ``tokens_per_month``).
        limit: its value.
        retry_after_s: seconds until retrying can succeed; ``None`` when waiting does not help.
        retryable: ``False`` for a used-up day or month budget and for a request
            larger than the limit.
    """

    def __init__(self, message: str, *, quota: str | None = None, limit: int | None = None,
                 retry_after_s: float | None = None, retryable: bool = True) -> None:  # fmt: skip
        super().__init__(message, "quota_exceeded")
        self.quota = quota
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.retryable = retryable


class InvalidRequest(ChatgateError):
    """The server refused the chat as asked: a bad parameter or message, a prompt too long for
    the context, a priority the tenant may not use, too many chats on one socket..."""


class ServerError(ChatgateError):
    """The server failed on the chat (engine error) or its store is down; retrying later may help."""


class ConnectionLost(ChatgateError):
    """The connection dropped while the chat was in flight (the server aborted it), or could not be
    (re-)established. The client reconnects by itself; start the chat again to retry it."""


_INVALID = {
    "invalid_json", "invalid_message", "unknown_type", "invalid_params", "invalid_parameter", "message_too_large",
    "duplicate_id", "too_many_chats", "forbidden_priority", "prompt_too_long", "unknown_id", "already_authenticated",
    "empty_messages", "invalid_request",
}  # fmt: skip
_SERVER = {"engine_error", "store_unavailable"}


def error_from_event(event: dict) -> ChatgateError:
    """The exception for a server ``error`` event."""
    code, message = event.get("code"), event.get("message") or "error"
    if code == "quota_exceeded":
        retry_ms = event.get("retry_after_ms")
        return QuotaExceeded(
            message, quota=event.get("quota"), limit=event.get("limit"),
            retry_after_s=None if retry_ms is None else retry_ms / 1000.0, retryable=bool(event.get("retryable", True)),
        )  # fmt: skip
    if code in _SERVER:
        return ServerError(message, code)
    if code in _INVALID:
        return InvalidRequest(message, code)
    return ChatgateError(message, code)
