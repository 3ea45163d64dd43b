"""SQLAlchemy 2 ORM models of the tenancy schema.

The schema itself is created and changed only by the Alembic migrations in
``migrations/``; these classes must match them (a test compares the two).
Timestamps are UTC; SQLite returns them naive, so ``as_utc`` restores the zone.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    BigInteger,
    MetaData,
    String,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .records import KeyInfo, Quotas, TenantInfo, decode_priorities

# Deterministic constraint names, so migrations can refer to them on both databases.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("weight > 0", name="weight_positive"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    weight: Mapped[float] = mapped_column(Float, nullable=False, default=1.0)
    # Comma-joined class names, highest first (see records.encode_priorities).
    allowed_priorities: Mapped[str] = mapped_column(String(64), nullable=False)
    disabled: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    # Quotas (issue 6); NULL means unlimited.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_concurrent_chats: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_month: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=utcnow, onupdate=utcnow
    )


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True
    )
    prefix: Mapped[str] = mapped_column(String(16), nullable=False, unique=True)
    digest: Mapped[str] = mapped_column(String(64), nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class TenantUsage(Base):
    """Live quota counters of one tenant (one row per tenant, created on first use).

    Windows are integers: ``minute_start`` is the UTC unix minute (``epoch_s // 60``),
    ``day_start`` the UTC unix day (``epoch_s // 86400``), ``month_start`` is
    ``year * 12 + month - 1``. A counter whose window is not the current one counts
    as 0; the reservation statement rolls it over (see ``tenancy.quotas``).
    ``in_flight`` and ``reserved_tokens`` count reservations not yet settled.
    """

    __tablename__ = "tenant_usage"

    tenant_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    minute_start: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    minute_requests: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    minute_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    in_flight: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    day_start: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    day_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    month_start: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    month_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class UsageRecord(Base):
    """One finished request (however it ended): what it cost and how it went."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_id_minute", "tenant_id", "minute"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
    )
    key_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    priority: Mapped[str] = mapped_column(String(16), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    reserved_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_ms: Mapped[float] = mapped_column(Float, nullable=False)
    finish_reason: Mapped[str] = mapped_column(String(16), nullable=False)
    minute: Mapped[int] = mapped_column(BigInteger, nullable=False)  # UTC unix minute, for time series
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


# ---- ORM rows -> frozen records (nothing outside the package sees ORM objects) ----


def tenant_quotas(tenant: Tenant) -> Quotas:
    return Quotas(**{field: getattr(tenant, field) for field in Quotas.__dataclass_fields__})


def tenant_info(tenant: Tenant) -> TenantInfo:
    return TenantInfo(
        id=tenant.id,
        name=tenant.name,
        weight=tenant.weight,
        allowed_priorities=decode_priorities(tenant.allowed_priorities),
        disabled=tenant.disabled,
        quotas=tenant_quotas(tenant),
        created_at=as_utc(tenant.created_at),
        updated_at=as_utc(tenant.updated_at),
    )


def key_info(key: ApiKey, tenant_name: str) -> KeyInfo:
    return KeyInfo(
        id=key.id,
        tenant_id=key.tenant_id,
        tenant_name=tenant_name,
        prefix=key.prefix,
        created_at=as_utc(key.created_at),
        revoked_at=as_utc(key.revoked_at),
        last_used_at=as_utc(key.last_used_at),
    )
