"""Run the Alembic migrations in ``migrations/`` from code.

The Alembic configuration is built here, not read from ``alembic.ini``, so
``chatgate db upgrade`` works from any working directory. The scripts are found
next to this package (``<repo>/migrations``, also right for an editable install)
or, failing that, as an importable ``migrations`` package.

``upgrade_async`` is the coroutine; ``upgrade`` is a sync wrapper that also works
when called from inside a running event loop (it then runs the migration on a
worker thread with its own loop and blocks until it is done).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from .db import async_url, create_engine, translate_errors


def migrations_dir() -> Path:
    """Directory holding ``env.py`` and ``versions/``.

    Raises:
        FileNotFoundError: neither the repository folder nor an installed package was found.
    """
    beside = Path(__file__).resolve().parent.parent / "migrations"
    if (beside / "env.py").is_file():
        return beside
    spec = importlib.util.find_spec("migrations")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "env.py").is_file():
                return Path(location)
    raise FileNotFoundError("cannot find the chatgate migrations directory (migrations/env.py)")


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic ``Config`` pointing at our scripts; no ini file, no logging changes."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    if database_url is not None:
        config.set_main_option(
            "sqlalchemy.url", async_url(database_url).render_as_string(hide_password=False).replace("%", "%%")
        )
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def upgrade_async(database_url: str, revision: str = "head") -> None:
    """Migrate the database at ``database_url`` up to ``revision``.

    Raises:
        StoreUnavailableError: the database cannot be reached.
    """
    await _run(database_url, lambda conn, cfg: command.upgrade(cfg, revision))


async def downgrade_async(database_url: str, revision: str) -> None:
    """Migrate down to ``revision`` (``"base"`` drops the whole schema)."""
    await _run(database_url, lambda conn, cfg: command.downgrade(cfg, revision))


async def current_revision_async(database_url: str) -> str | None:
    """The revision the database is at, or ``None`` before the first migration."""
    engine = create_engine(database_url)
    try:
        with translate_errors():
            async with engine.connect() as conn:
                return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
    finally:
        await engine.dispose()


def upgrade(database_url: str, revision: str = "head") -> None:
    """Sync form of ``upgrade_async``; safe to call with or without a running event loop."""
    _run_sync(upgrade_async(database_url, revision))


def downgrade(database_url: str, revision: str) -> None:
    _run_sync(downgrade_async(database_url, revision))


def current_revision(database_url: str) -> str | None:
    return _run_sync(current_revision_async(database_url))


async def _run(database_url: str, action) -> None:  # noqa: ANN001
    # The Alembic cookbook's recipe for async drivers: hand env.py a sync-facing
    # connection through config.attributes and run the command in run_sync.
    config = alembic_config(database_url)
    engine = create_engine(database_url)
    try:
        with translate_errors():
            async with engine.begin() as conn:
                await conn.run_sync(_with_connection, config, action)
    finally:
        await engine.dispose()


def _with_connection(conn: Connection, config: Config, action) -> None:  # noqa: ANN001
    config.attributes["connection"] = conn
    action(conn, config)


def _run_sync(coro):  # noqa: ANN001, ANN202
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatgate-migrate") as pool:
        return pool.submit(asyncio.run, coro).result()
