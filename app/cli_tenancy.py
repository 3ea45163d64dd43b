"""``chatgate db|tenants|keys`` subcommands: schema migrations, tenants and API keys.

Exit codes: 0 ok, 1 the request failed (not found, already exists, invalid
value), 2 usage error (argparse), 3 the database is unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TypeVar

EXIT_FAILED = 1
EXIT_UNAVAILABLE = 3

T = TypeVar("T")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``db``, ``tenants`` and ``keys`` command groups."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url",
        help="SQLAlchemy URL (sqlite+aiosqlite:///path or postgresql+asyncpg://...); "
        "default: CHATGATE_DATABASE_URL or <data_dir>/chatgate.db",
    )

    db = subparsers.add_parser("db", help="database schema").add_subparsers(dest="db_command", required=True)
    p = db.add_parser("upgrade", parents=[common], help="apply migrations up to the latest (or --revision)")
    p.add_argument("--revision", default="head")
    p.set_defaults(func=_db_upgrade)
    db.add_parser("current", parents=[common], help="show the schema revision").set_defaults(func=_db_current)

    tenants = subparsers.add_parser("tenants", help="manage tenants").add_subparsers(
        dest="tenants_command", required=True
    )
    p = tenants.add_parser("create", parents=[common], help="create a tenant and its first API key")
    p.add_argument("name")
    p.add_argument("--weight", type=float, default=1.0, help="fair-share weight, > 0 (default 1.0)")
    p.add_argument(
        "--priorities",
        default=None,
        help="allowed priority classes, comma-separated among interactive,standard,batch "
        "(default standard,batch)",
    )
    p.set_defaults(func=_tenants_create)
    tenants.add_parser("list", parents=[common], help="list tenants").set_defaults(func=_tenants_list)
    for verb in ("disable", "enable"):
        p = tenants.add_parser(verb, parents=[common], help=f"{verb} a tenant (its keys stop/start working)")
        p.add_argument("name")
        p.set_defaults(func=_tenants_set_disabled, disabled=verb == "disable")

    p = tenants.add_parser("update", parents=[common], help="set weight, priority classes and quotas")
    p.add_argument("name")
    p.add_argument("--weight", type=float, help="fair-share weight, > 0")
    p.add_argument("--priorities", help="allowed classes, comma-separated among interactive,standard,batch")
    for flag, field, what in _QUOTA_FLAGS:
        p.add_argument(flag, dest=field, type=_limit, default=_UNSET, metavar="N|none", help=f"{what} (none: unlimited)")
    p.set_defaults(func=_tenants_update)

    p = subparsers.add_parser("usage", parents=[common], help="usage against quotas, per tenant or of one tenant")
    p.add_argument("tenant", nargs="?", help="show this tenant's per-minute series and recent requests")
    p.add_argument("--minutes", type=int, default=60, help="series window for one tenant (default 60)")
    p.set_defaults(func=_usage)

    keys = subparsers.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", parents=[common], help="issue a new API key (shown once)")
    p.add_argument("tenant")
    p.set_defaults(func=_keys_create)
    p = keys.add_parser("list", parents=[common], help="list a tenant's keys (prefixes only)")
    p.add_argument("tenant")
    p.set_defaults(func=_keys_list)
    p = keys.add_parser("revoke", parents=[common], help="revoke a key by prefix (cg_xxxxxxxx) or id")
    p.add_argument("prefix")
    p.set_defaults(func=_keys_revoke)


_QUOTA_FLAGS = (
    ("--rpm", "requests_per_minute", "requests per minute"),
    ("--tpm", "tokens_per_minute", "tokens per minute (input + output)"),
    ("--max-concurrent", "max_concurrent_chats", "concurrent chats"),
    ("--tokens-per-day", "tokens_per_day", "tokens per UTC day"),
    ("--tokens-per-month", "tokens_per_month", "tokens per calendar month"),
)
_UNSET = object()


def _limit(text: str) -> int | None:
    if text.strip().lower() in ("none", "unlimited", "null", "-"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'none', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'none', got {text!r}")
    return value


# ---- handlers --------------------------------------------------------------------------


def _db_upgrade(args: argparse.Namespace) -> int:
    from tenancy import migrate

    url = _database_url(args)

    async def run() -> str | None:
        await migrate.upgrade_async(url, args.revision)
        return await migrate.current_revision_async(url)

    return _run(lambda: run(), lambda rev: _info(f"database {_safe(url)} is at revision {rev}"))


def _db_current(args: argparse.Namespace) -> int:
    from tenancy import migrate

    url = _database_url(args)
    return _run(
        lambda: migrate.current_revision_async(url),
        lambda rev: print(f"{rev or 'none (run `chatgate db upgrade`)'} (head: {migrate.head_revision()})"),
    )


def _tenants_create(args: argparse.Namespace) -> int:
    async def create(store):  # noqa: ANN001, ANN202
        tenant = await store.create_tenant(args.name, weight=args.weight, allowed_priorities=args.priorities)
        key, plain = await store.create_key(tenant.name)
        return tenant, key, plain

    def show(result) -> None:  # noqa: ANN001
        tenant, key, plain = result
        _info(
            f"created tenant {tenant.name} (id {tenant.id}, weight {tenant.weight:g}, "
            f"priorities {_priorities(tenant.allowed_priorities)})"
        )
        _show_new_key(key, plain)

    return _with_store(args, create, show)


def _tenants_list(args: argparse.Namespace) -> int:
    def show(tenants) -> None:  # noqa: ANN001
        rows = [
            (str(t.id), t.name, f"{t.weight:g}", _priorities(t.allowed_priorities),
             "disabled" if t.disabled else "active", _when(t.created_at))
            for t in tenants
        ]
        _table(("ID", "NAME", "WEIGHT", "PRIORITIES", "STATUS", "CREATED"), rows)

    return _with_store(args, lambda store: store.list_tenants(), show)


def _tenants_set_disabled(args: argparse.Namespace) -> int:
    return _with_store(
        args,
        lambda store: store.set_disabled(args.name, args.disabled),
        lambda t: _info(f"tenant {t.name} is now {'disabled' if t.disabled else 'enabled'}"),
    )


def _tenants_update(args: argparse.Namespace) -> int:
    changes = {field: getattr(args, field) for _, field, _ in _QUOTA_FLAGS if getattr(args, field) is not _UNSET}

    def show(t) -> None:  # noqa: ANN001
        quotas = ", ".join(f"{k}={'unlimited' if v is None else v}" for k, v in vars(t.quotas).items())
        _info(f"tenant {t.name}: weight {t.weight:g}, priorities {_priorities(t.allowed_priorities)}, {quotas}")

    return _with_store(
        args,
        lambda store: store.update_tenant(
            args.name, weight=args.weight, allowed_priorities=args.priorities, quota_changes=changes
        ),
        show,
    )


def _usage(args: argparse.Namespace) -> int:
    import time

    async def fetch(store):  # noqa: ANN001, ANN202
        tenants = [await store.get_tenant(args.tenant)] if args.tenant else await store.list_tenants()
        live = await store.quotas.live_usage()
        today = await store.quotas.totals(since_minute=int(time.time() // 86400) * 1440)
        series = recent = None
        if args.tenant:
            start = int(time.time() // 60) - max(1, args.minutes) + 1
            series = await store.quotas.series(tenants[0].id, start, 1)
            recent = await store.quotas.recent(tenants[0].id, 10)
        return tenants, live, today, series, recent

    def show(result) -> None:  # noqa: ANN001
        tenants, live, today, series, recent = result
        rows = []
        for t in tenants:
            u, q, d = live.get(t.id), t.quotas, today.get(t.id, {})
            rows.append((
                t.name, _of(u.minute_requests, q.requests_per_minute), _of(u.minute_tokens, q.tokens_per_minute),
                _of(u.in_flight, q.max_concurrent_chats), _of(u.day_tokens, q.tokens_per_day),
                _of(u.month_tokens, q.tokens_per_month), str(d.get("requests", 0)),
            ))  # fmt: skip
        _table(("TENANT", "REQ/MIN", "TOK/MIN", "CONCURRENT", "TOK/DAY", "TOK/MONTH", "REQUESTS TODAY"), rows)
        if series is not None:
            print()
            _table(("MINUTE (UTC)", "REQUESTS", "PROMPT", "COMPLETION"), [
                (time.strftime("%Y-%m-%d %H:%M", time.gmtime(b["start_minute"] * 60)), str(b["requests"]),
                 str(b["prompt_tokens"]), str(b["completion_tokens"])) for b in series
            ])  # fmt: skip
            print()
            _table(("REQUEST", "CLASS", "IN", "OUT", "RESERVED", "FINISH", "TOTAL MS"), [
                (r["request_id"], r["priority"], str(r["prompt_tokens"]), str(r["completion_tokens"]),
                 str(r["reserved_tokens"]), r["finish_reason"], f"{r['total_ms']:.0f}") for r in recent
            ])  # fmt: skip

    return _with_store(args, fetch, show)


def _of(used: int, limit: int | None) -> str:
    return f"{used}/{'∞' if limit is None else limit}"


def _keys_create(args: argparse.Namespace) -> int:
    return _with_store(args, lambda store: store.create_key(args.tenant), lambda r: _show_new_key(*r))


def _keys_list(args: argparse.Namespace) -> int:
    def show(keys) -> None:  # noqa: ANN001
        rows = [
            (k.masked, str(k.id), "revoked" if k.revoked else "active", _when(k.created_at), _when(k.last_used_at))
            for k in keys
        ]
        _table(("KEY", "ID", "STATUS", "CREATED", "LAST USED"), rows)

    return _with_store(args, lambda store: store.list_keys(args.tenant), show)


def _keys_revoke(args: argparse.Namespace) -> int:
    return _with_store(
        args,
        lambda store: store.revoke_key(args.prefix),
        lambda k: _info(f"revoked key {k.prefix} of tenant {k.tenant_name}"),
    )


# ---- plumbing --------------------------------------------------------------------------


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return args.database_url
    from app.settings import get_settings

    return get_settings().database_url


def _with_store(args: argparse.Namespace, action: Callable[..., Awaitable[T]], show: Callable[[T], None]) -> int:
    from tenancy import TenancyStore

    async def run() -> T:
        async with TenancyStore(_database_url(args)) as store:
            return await action(store)

    return _run(run, show)


def _run(make: Callable[[], Awaitable[T]], show: Callable[[T], None]) -> int:
    """Run one store action under ``asyncio.run`` and map failures to messages and exit codes."""
    from pydantic import ValidationError

    from tenancy import StoreUnavailableError, TenancyError

    try:
        result = asyncio.run(make())
    except StoreUnavailableError as error:
        _error(str(error))
        return EXIT_UNAVAILABLE
    except (TenancyError, ValueError, ValidationError) as error:
        _error(str(error))
        return EXIT_FAILED
    show(result)
    return 0


def _show_new_key(key, plain: str) -> None:  # noqa: ANN001
    # The key alone goes to stdout (so `KEY=$(chatgate keys create acme)` works);
    # everything else goes to stderr.
    _info(f"API key {key.prefix} for tenant {key.tenant_name}:")
    print(plain)
    _info("WARNING: store this key now; it will not be shown again (only its hash is kept).")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _priorities(names: frozenset[str]) -> str:
    from tenancy.records import encode_priorities

    return encode_priorities(names)


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _info(message: str) -> None:
    print(message, file=sys.stderr)


def _error(message: str) -> None:
    print(f"chatgate: error: {message}", file=sys.stderr)
