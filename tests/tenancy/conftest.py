"""Fixtures: every store test runs on SQLite (a tmp file) and on the real PostgreSQL.

PostgreSQL isolation: each test gets a fresh database ``cg_test_<random>``
created through the maintenance database ``test`` and dropped afterwards.
The server is 127.0.0.1:5432 (trust auth, user postgres or root) unless
CHATGATE_TEST_POSTGRES_URL names another; PostgreSQL tests are skipped only when
no server answers there, and the skip says so.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import pytest

from tenancy import TenancyStore
from tenancy.migrate import upgrade

_PG_CANDIDATES = (
    [os.environ["CHATGATE_TEST_POSTGRES_URL"]]
    if os.environ.get("CHATGATE_TEST_POSTGRES_URL")
    else ["postgresql://postgres@127.0.0.1:5432/test", "postgresql://root@127.0.0.1:5432/test"]
)
_pg_probe: tuple[str | None, str] | None = None  # (maintenance dsn, why not)


def _probe_postgres() -> tuple[str | None, str]:
    global _pg_probe
    if _pg_probe is None:
        _pg_probe = asyncio.run(_find_postgres())
    return _pg_probe


async def _find_postgres() -> tuple[str | None, str]:
    import asyncpg

    reasons = []
    for dsn in _PG_CANDIDATES:
        try:
            conn = await asyncpg.connect(dsn, timeout=3)
        except (OSError, asyncio.TimeoutError) as error:  # nothing listens / unreachable
            reasons.append(f"{dsn}: {type(error).__name__}: {error}")
            continue
        except asyncpg.PostgresError as error:  # it answers but refuses this user: try the next
            reasons.append(f"{dsn}: {type(error).__name__}: {error}")
            continue
        await conn.close()
        return dsn, ""
    return None, "; ".join(reasons)


async def _admin(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
def postgresql_url() -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database, dropped after the test."""
    dsn, why = _probe_postgres()
    if dsn is None:
        pytest.skip(f"PostgreSQL server not reachable ({why})")
    name = f"cg_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(dsn, f'CREATE DATABASE "{name}"'))
    base = dsn.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(_admin(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    # A directory that does not exist yet: the store must create it.
    return f"sqlite+aiosqlite:///{tmp_path / 'data' / 'chatgate.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request) -> str:
    """An empty database (no schema yet) of each supported kind."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def migrated_url(database_url: str) -> str:
    upgrade(database_url)
    return database_url


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(migrated_url: str):
    async with TenancyStore(migrated_url) as store:
        yield store
