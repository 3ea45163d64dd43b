"""``chatgate serve``: migrate the database, bootstrap a local tenant, serve the gateway.

On a loopback address with no tenant yet, ``serve`` creates the tenant ``local``
with one key and prints the chat page's link carrying that key in the URL fragment
(``http://127.0.0.1:8000/#key=...``), once: the key is shown nowhere else, and the
fragment never reaches a server log.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import secrets
import sys

LOCAL_TENANT = "local"
# Frames up to this many times the message limit get an ``error`` event; larger
# ones are cut off by the WebSocket layer itself (close 1009).
TRANSPORT_FRAME_FACTOR = 4


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the chat gateway (WebSocket /v1/ws, /health, chat page)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8000)")
    p.add_argument("--model", help="model name or GGUF path (default smollm2-135m-instruct)")
    p.add_argument("--database-url", help="sqlite+aiosqlite:///FILE or postgresql+asyncpg://... URL")
    p.add_argument("--data-dir", help="folder of the embedded SQLite database (default ./data)")
    p.add_argument("--allowed-origins", help="comma-separated browser origins allowed to connect")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("engine")
    g.add_argument("--device", help="cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--block-size", type=int, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, help="KV blocks in the pool (default: from free memory)")
    g.add_argument("--max-num-seqs", type=int, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one scheduler step")
    g.add_argument("--max-model-len", type=int, help="context length cap (default: the model's)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int,
                   help="split the model across this many ranks (GPUs from --device on; processes on the CPU)")
    p.set_defaults(func=serve)


_SETTING_ARGS = (
    "host", "port", "model", "database_url", "data_dir", "allowed_origins", "log_level", "device", "dtype",
    "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "tensor_parallel_size",
)  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.logging_setup import configure_logging, uvicorn_log_config
    from app.server import create_app
    from app.settings import get_settings

    from pydantic import ValidationError

    try:
        settings = get_settings(**{k: getattr(args, k) for k in _SETTING_ARGS if getattr(args, k) is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        print(f"chatgate serve: {problems}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    key = asyncio.run(bootstrap(settings.database_url, settings.host))
    base = f"http://{_url_host(settings.host)}:{settings.port}/"
    admin_token = None
    if settings.admin_token is None and is_loopback(settings.host):
        # A token for this session only, so the admin page works out of the box on loopback.
        from pydantic import SecretStr

        admin_token = secrets.token_urlsafe(32)
        settings = settings.model_copy(update={"admin_token": SecretStr(admin_token)})

    def announce() -> None:
        if admin_token is not None:
            print(f"\nchatgate: admin page (token for this session only; set CHATGATE_ADMIN_TOKEN to fix one):\n"
                  f"\n    {base}admin/#token={admin_token}\n", flush=True)  # fmt: skip
        if key is not None:
            print(f"\nchatgate: created tenant '{LOCAL_TENANT}'. Open the chat page (the key is shown only once):\n"
                  f"\n    {base}#key={key}\n", flush=True)  # fmt: skip
        else:
            print(f"\nchatgate: serving {settings.model} at {base}  (new keys: chatgate keys create TENANT)\n",
                  flush=True)  # fmt: skip

    print(f"chatgate: loading {settings.model} on {settings.device} (the first start converts the model files)…",
          flush=True)  # fmt: skip
    # The engine loads before the server starts, so a bad model or engine option is one
    # line on stderr and exit status 2, not a traceback inside a failed lifespan.
    from app.server import load_engine
    from engine.errors import EngineDeadError
    from engine.loader import ModelLoadError

    try:
        llm = load_engine(settings)
    except (ModelLoadError, ValueError, EngineDeadError) as exc:
        print(f"chatgate serve: {exc}", file=sys.stderr)
        return 2
    try:
        uvicorn.run(
            create_app(settings, llm=llm, on_ready=announce),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            log_config=uvicorn_log_config(),
            ws_max_size=TRANSPORT_FRAME_FACTOR * settings.ws_max_message_bytes,
        )
    finally:
        llm.shutdown()  # the engine thread, and tensor-parallel workers if any
    return 0


async def bootstrap(database_url: str, host: str) -> str | None:
    """Migrate the database; on loopback with no tenant, create ``local`` and return its new key."""
    from tenancy.migrate import upgrade_async
    from tenancy.store import TenancyStore

    await upgrade_async(database_url)
    if not is_loopback(host):
        return None
    async with TenancyStore(database_url) as store:
        if await store.count_tenants() > 0:
            return None
        await store.create_tenant(LOCAL_TENANT, allowed_priorities={"interactive", "standard", "batch"})
        _info, key = await store.create_key(LOCAL_TENANT)
        return key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
