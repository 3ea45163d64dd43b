"""The async tenancy store: tenants, API keys and key verification.

SQLite (aiosqlite) and PostgreSQL (asyncpg) run the same code; only the URL
differs. The schema must exist already (``tenancy.migrate.upgrade``). Every
method returns frozen dataclasses from ``tenancy.records``, never ORM objects,
and every "database cannot be used" failure surfaces as ``StoreUnavailableError``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from . import keys
from .db import create_engine, translate_errors
from .errors import NotFoundError, TenantExistsError
from .quotas import QuotaLedger
from .models import ApiKey, Tenant, key_info, tenant_info, tenant_quotas, utcnow
from .records import KeyInfo, Principal, Quotas, TenantInfo, decode_priorities, encode_priorities
from .validation import check_name, check_weight, normalize_priorities, quota_columns

log = logging.getLogger(__name__)

_KEY_PREFIX_ATTEMPTS = 5


class TenancyStore:
    """Tenants and API keys in a SQL database.

    Args:
        database_url: ``sqlite+aiosqlite:///path/to/file.db`` (directory created if
            absent) or ``postgresql+asyncpg://user@host:port/db``; plain
            ``sqlite://`` and ``postgresql://`` URLs get the async driver.

    Raises (every async method):
        StoreUnavailableError: the database is down, unreachable, locked past the
            busy timeout, or has no schema (``SchemaNotReadyError``).
    """

    def __init__(self, database_url: str, *, clock: Callable[[], float] = time.time) -> None:
        self._engine = create_engine(database_url)
        self._sessions = async_sessionmaker(self._engine, expire_on_commit=False)
        #: Quota reservation, settlement and usage reads (``tenancy.quotas.QuotaLedger``).
        self.quotas = QuotaLedger(self._transaction, clock)

    async def __aenter__(self) -> TenancyStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every pooled connection. The store must not be used afterwards."""
        await self._engine.dispose()

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncSession]:
        with translate_errors():
            async with self._sessions() as session, session.begin():
                yield session

    async def ping(self) -> None:
        """Round-trip to the database (for health checks). Raises ``StoreUnavailableError``."""
        async with self._transaction() as session:
            await session.execute(text("SELECT 1"))

    # ---- tenants -------------------------------------------------------------------------

    async def create_tenant(
        self,
        name: str,
        *,
        weight: float = 1.0,
        allowed_priorities: Iterable[str] | str | None = None,
        quotas: Quotas | None = None,
    ) -> TenantInfo:
        """Create a tenant.

        Args:
            name: unique; a letter then up to 63 of ``[A-Za-z0-9._-]``.
            weight: fair-share weight, > 0 (the scheduler divides served tokens by it).
            allowed_priorities: class names among interactive, standard, batch
                (default ``{"standard", "batch"}``).
            quotas: limits for issue 6's quota service; default unlimited.

        Raises:
            ValueError: bad name, weight or priority class.
            TenantExistsError: the name is taken.
        """
        tenant = Tenant(
            name=check_name(name),
            weight=check_weight(weight),
            allowed_priorities=encode_priorities(normalize_priorities(allowed_priorities)),
            disabled=False,
            **quota_columns(quotas or Quotas()),
        )
        try:
            async with self._transaction() as session:
                if await session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
                    raise TenantExistsError(f"tenant {name!r} already exists")
                session.add(tenant)
        except IntegrityError as error:  # lost a race with a concurrent create
            raise TenantExistsError(f"tenant {name!r} already exists") from error
        log.info("created tenant %s (id %d)", tenant.name, tenant.id)
        return tenant_info(tenant)

    async def list_tenants(self) -> list[TenantInfo]:
        """All tenants, ordered by id."""
        async with self._transaction() as session:
            rows = await session.scalars(select(Tenant).order_by(Tenant.id))
            return [tenant_info(t) for t in rows]

    async def count_tenants(self) -> int:
        async with self._transaction() as session:
            return int(await session.scalar(select(func.count()).select_from(Tenant)) or 0)

    async def get_tenant(self, name_or_id: str | int) -> TenantInfo:
        """The tenant with this name (or integer id). Raises ``NotFoundError``."""
        async with self._transaction() as session:
            return tenant_info(await _find_tenant(session, name_or_id))

    async def update_tenant(
        self,
        name_or_id: str | int,
        *,
        name: str | None = None,
        weight: float | None = None,
        allowed_priorities: Iterable[str] | str | None = None,
        quotas: Quotas | None = None,
        disabled: bool | None = None,
        quota_changes: dict[str, int | None] | None = None,
    ) -> TenantInfo:
        """Change the given fields (``None`` leaves a field as it is; ``quotas``
        replaces all quota limits at once; ``quota_changes`` sets only the quota
        fields it names, ``None`` values meaning unlimited).

        Raises:
            NotFoundError: no such tenant.
            TenantExistsError: the new name is taken.
            ValueError: bad name, weight or priority class.
        """
        changes: dict[str, object] = {}
        if name is not None:
            changes["name"] = check_name(name)
        if weight is not None:
            changes["weight"] = check_weight(weight)
        if allowed_priorities is not None:
            changes["allowed_priorities"] = encode_priorities(normalize_priorities(allowed_priorities))
        if quotas is not None:
            changes.update(quota_columns(quotas))
        if quota_changes:
            unknown = set(quota_changes) - set(Quotas.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown quota(s) {sorted(unknown)}")
            checked = quota_columns(Quotas(**quota_changes))
            changes.update({field: checked[field] for field in quota_changes})
        if disabled is not None:
            changes["disabled"] = bool(disabled)
        try:
            async with self._transaction() as session:
                tenant = await _find_tenant(session, name_or_id)
                for column, value in changes.items():
                    setattr(tenant, column, value)
                await session.flush()
                return tenant_info(tenant)
        except IntegrityError as error:
            raise TenantExistsError(f"tenant {name!r} already exists") from error

    async def set_disabled(self, name_or_id: str | int, disabled: bool) -> TenantInfo:
        """Disable (keys stop authenticating at once) or re-enable a tenant. Raises ``NotFoundError``."""
        return await self.update_tenant(name_or_id, disabled=disabled)

    async def delete_tenant(self, name_or_id: str | int) -> None:
        """Delete a tenant and its keys. Raises ``NotFoundError``."""
        async with self._transaction() as session:
            tenant = await _find_tenant(session, name_or_id)
            await session.execute(ApiKey.__table__.delete().where(ApiKey.tenant_id == tenant.id))
            await session.delete(tenant)

    # ---- API keys ------------------------------------------------------------------------

    async def create_key(self, tenant_name: str | int) -> tuple[KeyInfo, str]:
        """Issue a new API key for a tenant.

        Returns:
            ``(info, plain_key)``: the plain key exists only in this return value;
            only its SHA-256 digest is stored. Show it once.

        Raises:
            NotFoundError: no such tenant.
        """
        for attempt in range(_KEY_PREFIX_ATTEMPTS):
            prefix, plain_key = keys.generate_key()
            try:
                async with self._transaction() as session:
                    tenant = await _find_tenant(session, tenant_name)
                    key = ApiKey(tenant_id=tenant.id, prefix=prefix, digest=keys.digest_key(plain_key))
                    session.add(key)
                    await session.flush()
                    info = key_info(key, tenant.name)
            except IntegrityError:  # prefix collision (36**8 space): draw again
                if attempt == _KEY_PREFIX_ATTEMPTS - 1:
                    raise
                continue
            log.info("created key %s for tenant %s", prefix, info.tenant_name)
            return info, plain_key
        raise AssertionError("unreachable")

    async def list_all_keys(self) -> list[KeyInfo]:
        """Every key of every tenant, revoked ones included, by id; prefixes only."""
        async with self._transaction() as session:
            rows = await session.execute(
                select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.id)
            )
            return [key_info(k, name) for k, name in rows]

    async def list_keys(self, tenant_name: str | int) -> list[KeyInfo]:
        """A tenant's keys, revoked ones included, oldest first; prefixes only. Raises ``NotFoundError``."""
        async with self._transaction() as session:
            tenant = await _find_tenant(session, tenant_name)
            rows = await session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id))
            return [key_info(k, tenant.name) for k in rows]

    async def revoke_key(self, prefix_or_id: str | int) -> KeyInfo:
        """Revoke a key by its visible prefix (``cg_xxxxxxxx``) or integer id.

        Idempotent: revoking a revoked key keeps its first ``revoked_at``.
        Raises ``NotFoundError``.
        """
        async with self._transaction() as session:
            stmt = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
            if isinstance(prefix_or_id, int) or (isinstance(prefix_or_id, str) and prefix_or_id.isdigit()):
                stmt = stmt.where(ApiKey.id == int(prefix_or_id))
            else:
                stmt = stmt.where(ApiKey.prefix == str(prefix_or_id).removesuffix("_…"))
            row = (await session.execute(stmt)).first()
            if row is None:
                raise NotFoundError(f"no API key {prefix_or_id!r}")
            key, tenant_name = row
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            log.info("revoked key %s of tenant %s", key.prefix, tenant_name)
            return key_info(key, tenant_name)

    async def authenticate(self, plain_key: str) -> Principal | None:
        """Verify a presented API key.

        Looks the key up by its visible prefix, compares SHA-256 digests in
        constant time, and stamps ``last_used_at``.

        Returns:
            The ``Principal`` to act for, or ``None`` when the key is malformed,
            unknown, wrong, revoked, or its tenant is disabled (callers answer all
            of these the same way, so nothing leaks which one it was).

        Raises:
            StoreUnavailableError: the database cannot be used.
        """
        prefix = keys.parse_prefix(plain_key)
        if prefix is None:
            return None
        async with self._transaction() as session:
            stmt = select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.prefix == prefix)
            row = (await session.execute(stmt)).first()
            if row is None:
                return None
            key, tenant = row
            if not keys.verify_digest(plain_key, key.digest):
                return None
            if key.revoked_at is not None or tenant.disabled:
                return None
            await session.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=utcnow()))
            return Principal(
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                key_id=key.id,
                key_prefix=key.prefix,
                weight=tenant.weight,
                allowed_priorities=decode_priorities(tenant.allowed_priorities),
                quotas=tenant_quotas(tenant),
            )


# ---- helpers -----------------------------------------------------------------------------


async def _find_tenant(session: AsyncSession, name_or_id: str | int) -> Tenant:
    if isinstance(name_or_id, int):
        tenant = await session.get(Tenant, name_or_id)
    else:
        tenant = await session.scalar(select(Tenant).where(Tenant.name == name_or_id))
        if tenant is None and name_or_id.isdigit():  # names start with a letter, so no clash
            tenant = await session.get(Tenant, int(name_or_id))
    if tenant is None:
        raise NotFoundError(f"no tenant {name_or_id!r}")
    return tenant
