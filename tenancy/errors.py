"""Errors raised by the tenancy store.

The gateway maps them to answers: ``StoreUnavailableError`` to "service
unavailable" (HTTP 503 / WebSocket close 1013), the others to client errors.
"""

from __future__ import annotations


class TenancyError(Exception):
    """Base class of every error the tenancy package raises on purpose."""


class TenantExistsError(TenancyError):
    """A tenant with this name already exists."""


class NotFoundError(TenancyError):
    """No tenant or key matches the given name, id or prefix."""


class StoreUnavailableError(TenancyError):
    """The database cannot be reached or used right now (down, refused, timed out, locked)."""


class SchemaNotReadyError(StoreUnavailableError):
    """The database answers but has no tenancy schema: run ``chatgate db upgrade``."""


class PriorityNotAllowedError(TenancyError):
    """The request asks for a priority class its tenant may not use.

    Attributes:
        priority: the class asked for.
        allowed: the tenant's allowed classes, highest first.
    """

    def __init__(self, priority: str, allowed: list[str]) -> None:
        super().__init__(f"priority {priority!r} is not allowed for this tenant; allowed: {allowed}")
        self.priority = priority
        self.allowed = allowed


class QuotaExceededError(TenancyError):
    """A quota refused the request before the engine saw it.

    Attributes:
        quota_name: ``requests_per_minute``, ``tokens_per_minute``,
            ``max_concurrent_chats``, ``tokens_per_day`` or ``tokens_per_month``.
        limit: the limit that refused it.
        retry_after_s: seconds until the quota's window resets (minute, UTC day,
            calendar month), or ``None`` when no wait helps (a concurrency limit
            frees up when a chat ends; a request larger than the limit never fits).
        retryable: ``True`` when retrying soon can succeed (minute windows,
            concurrency); ``False`` for a used-up day/month budget (wait
            ``retry_after_s``) and for a request that can never fit.
    """

    def __init__(self, quota_name: str, limit: int, retry_after_s: float | None, retryable: bool, detail: str = "") -> None:
        when = f"; retry after {retry_after_s:.1f} s" if retry_after_s is not None else ""
        super().__init__(f"quota {quota_name} (limit {limit}) exceeded{': ' + detail if detail else ''}{when}")
        self.quota_name = quota_name
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.retryable = retryable
