"""The admin API under ``/admin``: tenants, keys, weights, priority classes, quotas, usage.

Every endpoint (``docs/admin.md`` lists them) needs ``Authorization: Bearer
<admin_token>`` (``CHATGATE_ADMIN_TOKEN``), compared in constant time; a tenant
API key is not an admin credential. Without a configured token every endpoint
answers 404 ``admin_disabled``. The admin page itself (``/admin/``) is a static
file and asks for the token in the browser.

Answers are JSON; errors are ``{"error": {"code", "message", ...}}`` with 401
(missing or wrong credential), 404 (no such tenant/key, or admin disabled), 409
(name taken), 422 (validation: ``fields`` lists each problem), 503 (store down).
Plain keys appear only in the answer that creates them; the token and keys are
never logged.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from tenancy.errors import NotFoundError, StoreUnavailableError, TenantExistsError
from tenancy.records import PRIORITY_CLASSES, KeyInfo, TenantInfo
from tenancy.validation import TENANT_NAME_RE

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
MAX_SERIES_MINUTES = 31 * 24 * 60

Priority = Literal["interactive", "standard", "batch"]
Limit = Annotated[int | None, Field(ge=0, le=2**62)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuotasBody(_Body):
    """Quota limits; ``null`` means unlimited. In a PATCH only the fields given change."""

    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    max_concurrent_chats: Limit = None
    tokens_per_day: Limit = None
    tokens_per_month: Limit = None


class TenantCreate(_Body):
    name: str = Field(pattern=TENANT_NAME_RE.pattern)
    weight: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    allowed_priorities: list[Priority] | None = Field(None, min_length=1)
    quotas: QuotasBody = QuotasBody()
    issue_key: bool = True  # also issue a first API key (returned once)


class TenantUpdate(_Body):
    name: str | None = Field(None, pattern=TENANT_NAME_RE.pattern)
    weight: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    allowed_priorities: list[Priority] | None = Field(None, min_length=1)
    quotas: QuotasBody | None = None
    disabled: bool | None = None


# ---------------------------------------------------------------- auth and errors


def _error(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="chatgate-admin"'} if status == 401 else None
    return JSONResponse({"error": {"code": code, "message": message, **extra}}, status, headers=headers)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def check_admin(request: Request) -> JSONResponse | None:
    """``None`` when the request carries the admin token; else the error answer to send."""
    secret = request.app.state.settings.admin_token
    if secret is None or not secret.get_secret_value():
        return _error(404, "admin_disabled", "the admin API is disabled: set CHATGATE_ADMIN_TOKEN to enable it")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return _error(401, "unauthorized", "admin credential required: Authorization: Bearer <admin token>")
    # Digests of equal length, compared in constant time: neither content nor length leaks.
    if not hmac.compare_digest(_digest(given.strip()), _digest(secret.get_secret_value())):
        return _error(401, "unauthorized", "invalid admin credential (a tenant API key is not one)")
    return None


Handler = Callable[[Request], Awaitable[Response]]


def admin_endpoint(handler: Handler) -> Handler:
    """Wrap a handler with the admin check and the error mapping."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        denied = check_admin(request)
        if denied is not None:
            return denied
        try:
            return await handler(request)
        except ValidationError as exc:
            fields = [{"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
                      for e in exc.errors(include_url=False, include_input=False)]  # fmt: skip
            text = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
            return _error(422, "invalid_request", text, fields=fields)
        except NotFoundError as exc:
            return _error(404, "not_found", str(exc))
        except TenantExistsError as exc:
            return _error(409, "tenant_exists", str(exc))
        except StoreUnavailableError as exc:
            return _error(503, "store_unavailable", str(exc))
        except ValueError as exc:
            return _error(422, "invalid_request", str(exc))

    return wrapped


async def _json_body(request: Request, model: type[_Body]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ValueError(f"the body is not valid JSON: {exc}") from None
    return model.model_validate(data)


# ---------------------------------------------------------------- views


def key_json(key: KeyInfo) -> dict[str, Any]:
    return {
        "id": key.id, "prefix": key.prefix, "masked": key.masked, "revoked": key.revoked,
        "created_at": _iso(key.created_at), "revoked_at": _iso(key.revoked_at), "last_used_at": _iso(key.last_used_at),
    }  # fmt: skip


def tenant_json(tenant: TenantInfo, keys: list[KeyInfo] | None = None, live: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": tenant.id, "name": tenant.name, "weight": tenant.weight,
        "allowed_priorities": [p for p in PRIORITY_CLASSES if p in tenant.allowed_priorities],
        "disabled": tenant.disabled, "quotas": vars(tenant.quotas),
        "created_at": _iso(tenant.created_at), "updated_at": _iso(tenant.updated_at),
    }  # fmt: skip
    if keys is not None:
        body["keys"] = [key_json(k) for k in keys]
    if live is not None:
        body["usage"] = _live_json(live)
    return body


def _live_json(live: Any) -> dict[str, int]:
    fields = ("minute_requests", "minute_tokens", "in_flight", "reserved_tokens", "day_tokens", "month_tokens")
    return {f: getattr(live, f) for f in fields}


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


# ---------------------------------------------------------------- handlers


@admin_endpoint
async def list_tenants(request: Request) -> Response:
    store = request.app.state.store
    tenants, keys, live = await store.list_tenants(), await store.list_all_keys(), await store.quotas.live_usage()
    by_tenant: dict[int, list[KeyInfo]] = {}
    for key in keys:
        by_tenant.setdefault(key.tenant_id, []).append(key)
    return JSONResponse({"tenants": [tenant_json(t, by_tenant.get(t.id, []), live.get(t.id)) for t in tenants]})


@admin_endpoint
async def create_tenant(request: Request) -> Response:
    body = await _json_body(request, TenantCreate)
    store = request.app.state.store
    from tenancy.records import Quotas

    tenant = await store.create_tenant(body.name, weight=body.weight, allowed_priorities=body.allowed_priorities,
                                       quotas=Quotas(**body.quotas.model_dump()))  # fmt: skip
    answer = tenant_json(tenant, [])
    if body.issue_key:
        info, plain = await store.create_key(tenant.name)
        answer["keys"] = [key_json(info)]
        answer["api_key"] = plain  # shown once
    return JSONResponse(answer, 201)


@admin_endpoint
async def get_tenant(request: Request) -> Response:
    store = request.app.state.store
    tenant = await store.get_tenant(request.path_params["name"])
    live = (await store.quotas.live_usage(tenant.id)).get(tenant.id)
    return JSONResponse(tenant_json(tenant, await store.list_keys(tenant.id), live))


@admin_endpoint
async def update_tenant(request: Request) -> Response:
    body = await _json_body(request, TenantUpdate)
    quota_changes = None
    if body.quotas is not None:
        quota_changes = {f: getattr(body.quotas, f) for f in body.quotas.model_fields_set}
    tenant = await request.app.state.store.update_tenant(
        request.path_params["name"], name=body.name, weight=body.weight,
        allowed_priorities=body.allowed_priorities, disabled=body.disabled, quota_changes=quota_changes,
    )  # fmt: skip
    return JSONResponse(tenant_json(tenant))


def _set_disabled(disabled: bool) -> Handler:
    @admin_endpoint
    async def handler(request: Request) -> Response:
        tenant = await request.app.state.store.set_disabled(request.path_params["name"], disabled)
        return JSONResponse(tenant_json(tenant))

    handler.__name__ = "disable_tenant" if disabled else "enable_tenant"
    return handler


@admin_endpoint
async def list_keys(request: Request) -> Response:
    keys = await request.app.state.store.list_keys(request.path_params["name"])
    return JSONResponse({"keys": [key_json(k) for k in keys]})


@admin_endpoint
async def create_key(request: Request) -> Response:
    info, plain = await request.app.state.store.create_key(request.path_params["name"])
    return JSONResponse({**key_json(info), "tenant": info.tenant_name, "api_key": plain}, 201)


@admin_endpoint
async def revoke_key(request: Request) -> Response:
    info = await request.app.state.store.revoke_key(request.path_params["prefix"])
    return JSONResponse({**key_json(info), "tenant": info.tenant_name})


@admin_endpoint
async def usage_totals(request: Request) -> Response:
    """Per tenant: live counters against quotas, and totals today and all time."""
    store = request.app.state.store
    today = int(time.time() // 86400) * 1440
    tenants, live = await store.list_tenants(), await store.quotas.live_usage()
    all_time, day = await store.quotas.totals(), await store.quotas.totals(since_minute=today)
    zero = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    rows = [
        {"tenant": t.name, "id": t.id, "quotas": vars(t.quotas), "live": _live_json(live[t.id]) if t.id in live else None,
         "today": day.get(t.id, zero), "all_time": all_time.get(t.id, zero)}
        for t in tenants
    ]  # fmt: skip
    return JSONResponse({"tenants": rows})


@admin_endpoint
async def usage_series(request: Request) -> Response:
    """``?minutes=60&bucket_minutes=1``: one point per bucket (zeros included), oldest first."""
    store = request.app.state.store
    tenant = await store.get_tenant(request.path_params["name"])
    minutes = _int_param(request, "minutes", 60, 1, MAX_SERIES_MINUTES)
    bucket = _int_param(request, "bucket_minutes", max(1, minutes // 60), 1, minutes)
    now_minute = int(time.time() // 60)
    start = (now_minute - minutes + 1) // bucket * bucket
    found = {b["start_minute"]: b for b in await store.quotas.series(tenant.id, start, bucket)}
    points = [
        found.get(m, {"start_minute": m, "requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        for m in range(start, now_minute + 1, bucket)
    ]
    for p in points:
        p["start"] = time.strftime("%Y-%m-%dT%H:%M:00Z", time.gmtime(p["start_minute"] * 60))
    recent = await store.quotas.recent(tenant.id, limit=_int_param(request, "recent", 20, 0, 500))
    for row in recent:
        row["created_at"] = _iso(row["created_at"])
    return JSONResponse({"tenant": tenant.name, "bucket_minutes": bucket, "points": points, "recent": recent})


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ValueError(f"query parameter {name!r} must be an integer in [{low}, {high}], got {raw!r}")
    return int(raw)


async def admin_page(request: Request) -> Response:
    """The static admin page (it asks for the token itself; no data without it)."""
    return FileResponse(WEB_DIR / "admin.html", headers={"Cache-Control": "no-store"})


def admin_routes() -> list[BaseRoute]:
    """Routes to mount at ``/admin``."""
    return [
        Route("/", admin_page, methods=["GET"]),
        Route("/tenants", list_tenants, methods=["GET"]),
        Route("/tenants", create_tenant, methods=["POST"]),
        Route("/tenants/{name}", get_tenant, methods=["GET"]),
        Route("/tenants/{name}", update_tenant, methods=["PATCH"]),
        Route("/tenants/{name}/disable", _set_disabled(True), methods=["POST"]),
        Route("/tenants/{name}/enable", _set_disabled(False), methods=["POST"]),
        Route("/tenants/{name}/keys", list_keys, methods=["GET"]),
        Route("/tenants/{name}/keys", create_key, methods=["POST"]),
        Route("/tenants/{name}/usage", usage_series, methods=["GET"]),
        Route("/keys/{prefix}", revoke_key, methods=["DELETE"]),
        Route("/usage", usage_totals, methods=["GET"]),
    ]


def admin_redirect(request: Request) -> Response:
    return RedirectResponse("/admin/", 308)
