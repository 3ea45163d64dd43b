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
