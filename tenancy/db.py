"""Async engines for SQLite (aiosqlite, embedded default) and PostgreSQL (asyncpg).

One code path for both: only the URL differs. SQLite files get their directory
created, WAL journaling, a busy timeout and foreign keys; PostgreSQL gets a
connect timeout so a dead server fails fast instead of hanging a request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import event, exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .errors import SchemaNotReadyError, StoreUnavailableError

SQLITE_BUSY_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_S = 5.0


class _DropOperationDebug(logging.Filter):
    """aiosqlite logs every operation with its bound parameters at DEBUG, which would
    put key digests in the logs; drop those records, keep everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.DEBUG


logging.getLogger("aiosqlite").addFilter(_DropOperationDebug())

_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


def async_url(database_url: str | URL) -> URL:
    """The URL with its async driver: ``sqlite://`` → ``sqlite+aiosqlite://``,
    ``postgres[ql]://`` → ``postgresql+asyncpg://``; already-async URLs pass through.

    Raises:
        ValueError: a database other than SQLite or PostgreSQL, or a sync driver.
    """
    url = make_url(database_url)
    backend, _, driver = url.drivername.partition("+")
    if backend not in _ASYNC_DRIVERS:
        raise ValueError(f"unsupported database {backend!r}: use sqlite+aiosqlite or postgresql+asyncpg")
    if not driver:
        return url.set(drivername=_ASYNC_DRIVERS[backend])
    if url.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
        raise ValueError(f"unsupported driver {url.drivername!r}: use sqlite+aiosqlite or postgresql+asyncpg")
    return url


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def create_engine(database_url: str | URL) -> AsyncEngine:
    """An ``AsyncEngine`` configured for the tenancy store (see module docstring).

    ``hide_parameters`` keeps bound values (key digests) out of error messages and logs.
    """
    url = async_url(database_url)
    if is_sqlite(url):
        return _create_sqlite_engine(url)
    return create_async_engine(
        url,
        hide_parameters=True,
        pool_pre_ping=True,
        connect_args={"timeout": CONNECT_TIMEOUT_S, "command_timeout": 30.0},
    )


def _create_sqlite_engine(url: URL) -> AsyncEngine:
    if url.database in (None, "", ":memory:") or url.database.startswith("file:"):
        raise ValueError("the tenancy store needs a SQLite file, not an in-memory database")
    try:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StoreUnavailableError(f"cannot create the SQLite directory: {error}") from error
    engine = create_async_engine(
        url, hide_parameters=True, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # noqa: ANN001
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer; NORMAL sync is durable enough under WAL.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


# SQLSTATE classes that mean "this database cannot serve us now": connection
# exception, invalid catalog (no such database), invalid authorization,
# insufficient resources (too many connections), operator intervention
# (shutdown, starting up), system error.
_UNAVAILABLE_SQLSTATE_CLASSES = frozenset({"08", "3D", "28", "53", "57", "58"})


def _sqlstate(error: exc.DBAPIError) -> str:
    return str(getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None) or "")


def _is_missing_table(error: BaseException) -> bool:
    text = str(error).lower()
    # SQLite: "no such table"; PostgreSQL: UndefinedTableError (SQLSTATE 42P01).
    return "no such table" in text or "undefinedtable" in text or "42p01" in text or (
        "relation" in text and "does not exist" in text
    )


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn "cannot reach/use the database" failures into ``StoreUnavailableError``.

    Integrity and data errors pass through untouched for the caller to map.
    """
    try:
        yield
    except (exc.IntegrityError, exc.DataError):
        raise
    except exc.DBAPIError as error:
        if _is_missing_table(error):
            raise SchemaNotReadyError(
                "the tenancy schema is missing: run `chatgate db upgrade`"
            ) from error
        if (
            isinstance(error, (exc.OperationalError, exc.InterfaceError))
            or error.connection_invalidated
            or _sqlstate(error)[:2] in _UNAVAILABLE_SQLSTATE_CLASSES
        ):
            # The driver's own message (never the statement or its parameters).
            detail = str(error.orig).strip().splitlines()[0][:200] if str(error.orig).strip() else ""
            raise StoreUnavailableError(f"database unavailable: {detail or type(error.orig).__name__}") from error
        raise
    except exc.TimeoutError as error:  # connection pool exhausted
        raise StoreUnavailableError("database unavailable: connection pool timed out") from error
    except (OSError, TimeoutError) as error:  # refused, unreachable, DNS, connect timeout (asyncpg)
        raise StoreUnavailableError(f"database unavailable: {type(error).__name__}: {error}") from error
