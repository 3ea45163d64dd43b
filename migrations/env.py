"""Alembic environment for chatgate (SQLite via aiosqlite, PostgreSQL via asyncpg).

Two ways in:
- programmatic (``tenancy.migrate``): a connection arrives in
  ``config.attributes["connection"]``; logging is left alone;
- the ``alembic`` command with ``alembic.ini`` at the repository root: the URL
  comes from ``-x url=...``, ``sqlalchemy.url``, or the chatgate settings.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tenancy.models import Base

config = context.config
target_metadata = Base.metadata

# Any constant works; it only has to be the same for every replica.
_PG_MIGRATION_LOCK_ID = 0x63686174  # "chat"


def _database_url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from app.settings import get_settings  # only for the bare `alembic` command

    return get_settings().database_url


def do_run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas starting together migrate one at a time; released at commit.
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _PG_MIGRATION_LOCK_ID})
        context.run_migrations()


async def _run_async_migrations() -> None:
    from tenancy.db import create_engine

    engine = create_engine(_database_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    do_run_migrations(connection)
elif context.is_offline_mode():
    run_migrations_offline()
else:
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    asyncio.run(_run_async_migrations())
