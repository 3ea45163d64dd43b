"""The Starlette application: ``/v1/ws`` chat, ``/health``, and the chat page at ``/``.

``create_app`` builds the app; its lifespan migrates the database and opens the
tenancy store, and loads the engine, unless the caller hands in ready ones (tests,
``chatgate serve``). Whatever the lifespan opened, it also closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics import InstrumentedLLM, MeteredChatService, Metrics, metrics_endpoint
from app.openai_api import routes as openai_routes
from app.admin_api import admin_redirect, admin_routes
from app.chat_service import ChatService
from app.settings import Settings
from app.ws import websocket_endpoint

log = logging.getLogger("chatgate.server")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
HEALTH_DB_TIMEOUT_S = 2.0

# The chat page loads only its own files and talks only to its own origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def create_app(
    settings: Settings,
    *,
    llm: Any | None = None,
    store: Any | None = None,
    on_ready: Callable[[], None] | None = None,
) -> Starlette:
    """Build the gateway.

    Args:
        settings: server, engine and limit settings (``app.settings.Settings``).
        llm: a running ``engine.AsyncLLM``; ``None`` loads one from ``settings`` at
            startup (and shuts it down at exit).
        store: an open ``tenancy.store.TenancyStore``; ``None`` migrates
            ``settings.database_url`` and opens one at startup (closed at exit).
        on_ready: called once startup is complete, just before the server listens.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owned_store = owned_llm = None
        try:
            if store is None:
                owned_store = await _open_store(settings.database_url)
            if llm is None:
                owned_llm = await asyncio.to_thread(load_engine, settings)
            app.state.store = store if store is not None else owned_store
            engine_client = llm if llm is not None else owned_llm
            app.state.metrics = Metrics(engine_client.model_name, engine_client.stats)
            app.state.llm = InstrumentedLLM(engine_client, app.state.metrics, log_prompts=settings.log_prompts)
            service = ChatService(app.state.llm, app.state.store, settings)
            app.state.chat_service = MeteredChatService(service, app.state.metrics)
            if on_ready is not None:
                on_ready()
            yield
        finally:
            if getattr(app.state, "chat_service", None) is not None:
                await app.state.chat_service.drain()
            if owned_llm is not None:
                owned_llm.shutdown()
            if owned_store is not None:
                await owned_store.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            *openai_routes(),
            WebSocketRoute("/v1/ws", websocket_endpoint),
            Route("/admin", admin_redirect, methods=["GET"]),
            Mount("/admin", routes=admin_routes()),
            Mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web"),
        ],
        middleware=[Middleware(SecurityHeaders)],
        lifespan=lifespan,
    )
    app.state.settings = settings
    return app


def load_engine(settings: Settings) -> Any:
    """Load the model and start the engine's core loop (seconds to minutes)."""
    from engine import AsyncLLM

    log.info("loading model %s on %s (%s)", settings.model, settings.device, settings.dtype)
    return AsyncLLM(**settings.engine_options())


async def _open_store(database_url: str) -> Any:
    from tenancy.migrate import upgrade
    from tenancy.store import TenancyStore

    await asyncio.to_thread(upgrade, database_url)
    return TenancyStore(database_url)


async def health(request: Request) -> JSONResponse:
    """Engine state and database reachability; 200 when both are fine, else 503 (a dead
    engine, e.g. a lost tensor-parallel worker, says why in ``engine.error``)."""
    state = request.app.state
    stats = state.llm.stats()
    try:
        await asyncio.wait_for(state.store.ping(), HEALTH_DB_TIMEOUT_S)
        database = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means unreachable
        database = f"unavailable: {type(exc).__name__}"
    alive = getattr(state.llm, "is_alive", True)
    healthy = database == "ok" and alive
    body = {
        "status": "ok" if healthy else "degraded",
        "model": stats.get("model"),
        "engine": {
            "running": stats.get("num_running"),
            "waiting": stats.get("num_waiting"),
            "swapped": stats.get("num_swapped"),
            "free_kv_blocks": stats.get("free_gpu_blocks"),
            "total_kv_blocks": stats.get("total_gpu_blocks"),
            "alive": alive,
            **({"error": state.llm.dead_reason} if not alive and getattr(state.llm, "dead_reason", None) else {}),
        },
        # The engine's counters as LLM.stats() names them (preemptions, swap, prefix cache, pools).
        "stats": {k: v for k, v in stats.items() if k != "model"},
        "database": database,
    }
    return JSONResponse(body, status_code=200 if healthy else 503)


class SecurityHeaders:
    """Adds a Content-Security-Policy and friends to every HTTP answer (not to WebSockets)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
