"""Alembic migrations: they alone create the schema, identically on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from tenancy import SchemaNotReadyError, TenancyStore
from tenancy.db import create_engine
from tenancy.migrate import current_revision, downgrade, head_revision, migrations_dir, upgrade, upgrade_async
from tenancy.models import Base


async def _inspect(url: str, fn):
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(fn)
    finally:
        await engine.dispose()


def _tables(url: str) -> set[str]:
    return set(asyncio.run(_inspect(url, lambda c: inspect(c).get_table_names())))


def test_upgrade_creates_schema(database_url):
    assert current_revision(database_url) is None
    upgrade(database_url)
    assert {"tenants", "api_keys", "alembic_version"} <= _tables(database_url)
    assert current_revision(database_url) == head_revision() is not None


def test_upgrade_twice_is_a_no_op(database_url):
    upgrade(database_url)
    upgrade(database_url)
    assert current_revision(database_url) == head_revision()


def test_orm_models_match_migrated_schema(migrated_url):
    def diff(conn):
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)

    assert asyncio.run(_inspect(migrated_url, diff)) == []


def test_downgrade_to_base_drops_schema(migrated_url):
    downgrade(migrated_url, "base")
    assert _tables(migrated_url) <= {"alembic_version"}
    assert current_revision(migrated_url) is None


def test_upgrade_works_inside_a_running_event_loop(database_url):
    async def main():
        upgrade(database_url)  # sync form from inside a loop: runs on a worker thread
        await upgrade_async(database_url)

    asyncio.run(main())
    assert current_revision(database_url) == head_revision()


def test_upgrade_finds_migrations_from_any_cwd(sqlite_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (migrations_dir() / "env.py").is_file()
    upgrade(sqlite_url)
    assert current_revision(sqlite_url) == head_revision()


def test_plain_sqlite_url_gets_async_driver(tmp_path):
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    upgrade(url)
    assert current_revision(url) == head_revision()


@pytest.mark.anyio
async def test_store_without_schema_says_run_upgrade(database_url):
    async with TenancyStore(database_url) as store:
        with pytest.raises(SchemaNotReadyError, match="chatgate db upgrade"):
            await store.list_tenants()


def test_sqlite_runs_in_wal_mode_with_busy_timeout(sqlite_url):
    upgrade(sqlite_url)

    def pragmas(conn):
        return (
            conn.execute(text("PRAGMA journal_mode")).scalar(),
            conn.execute(text("PRAGMA busy_timeout")).scalar(),
            conn.execute(text("PRAGMA foreign_keys")).scalar(),
        )

    journal, busy_ms, foreign_keys = asyncio.run(_inspect(sqlite_url, pragmas))
    assert journal == "wal" and busy_ms >= 1000 and foreign_keys == 1
