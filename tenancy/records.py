"""Plain values the store returns: frozen dataclasses, never ORM objects."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

# Highest first; the engine maps these names onto its own priority classes.
PRIORITY_CLASSES: tuple[str, ...] = ("interactive", "standard", "batch")
DEFAULT_PRIORITIES: frozenset[str] = frozenset({"standard", "batch"})


def normalize_priorities(names: Iterable[str] | str | None) -> frozenset[str]:
    """Validate a set of priority class names; a string is split on commas.

    ``None`` gives the default ``{"standard", "batch"}``.

    Raises:
        ValueError: an unknown class name, or an empty set.
    """
    if names is None:
        return DEFAULT_PRIORITIES
    if isinstance(names, str):
        names = names.split(",")
    result = frozenset(n.strip().lower() for n in names if n.strip())
    unknown = result - set(PRIORITY_CLASSES)
    if unknown:
        raise ValueError(
            f"unknown priority class(es) {sorted(unknown)}; choose among {list(PRIORITY_CLASSES)}"
        )
    if not result:
        raise ValueError("a tenant needs at least one allowed priority class")
    return result


def encode_priorities(names: frozenset[str]) -> str:
    """Canonical column text: comma-joined, highest class first."""
    return ",".join(p for p in PRIORITY_CLASSES if p in names)


def decode_priorities(text: str) -> frozenset[str]:
    return frozenset(p for p in text.split(",") if p)


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; ``None`` means unlimited. Enforced by the quota service (issue 6).

    Units: requests and tokens per minute, concurrent chat streams, tokens per UTC
    day and per calendar month.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_chats: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None


QUOTA_FIELDS: tuple[str, ...] = tuple(Quotas.__dataclass_fields__)


@dataclass(frozen=True)
class TenantInfo:
    id: int
    name: str
    weight: float
    allowed_priorities: frozenset[str]
    disabled: bool
    quotas: Quotas
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class KeyInfo:
    """An API key as it may be shown: the visible prefix only, never the secret."""

    id: int
    tenant_id: int
    tenant_name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def masked(self) -> str:
        return f"{self.prefix}_…"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class Principal:
    """Who a request acts for, once its key is verified; the engine takes these as plain values."""

    tenant_id: int
    tenant_name: str
    key_id: int
    key_prefix: str
    weight: float
    allowed_priorities: frozenset[str]
    quotas: Quotas = Quotas()
