"""Start the real gateway (``chatgate serve`` in a subprocess) and talk to it like a client.

``GatewayServer`` runs ``python -m app.cli serve`` on a free loopback port with a
real SQLite file, captures its stdout and stderr to files (to check that no key is
ever logged), reads the bootstrap link of the ``local`` tenant, and creates more
tenants through the real ``TenancyStore`` on the same database file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets

REPO_ROOT = Path(__file__).resolve().parents[2]
LINK_RE = re.compile(r"http://127\.0\.0\.1:\d+/#key=(\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayServer:
    """One ``chatgate serve`` process; ``keys`` maps tenant name to its plain key."""

    workdir: Path
    model: str
    max_model_len: int
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    keys: dict[str, str] = field(default_factory=dict)
    all_keys: list[str] = field(default_factory=list)  # every key ever issued, for the log check
    proc: subprocess.Popen | None = None

    @property
    def database_url(self) -> str:
        return f"sqlite+aiosqlite:///{self.workdir / 'chatgate.db'}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def start(self, timeout_s: float = 300.0) -> None:
        cmd = [
            sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--model", self.model, "--database-url", self.database_url,
            "--max-model-len", str(self.max_model_len), "--log-level", "info",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **self.extra_env}
        self.stdout_path = self.workdir / "server.stdout"
        self.stderr_path = self.workdir / "server.stderr"
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=self.stdout_path.open("wb"), stderr=self.stderr_path.open("wb"),
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.logs()[-4000:]}")
        match = LINK_RE.search(self.stdout_path.read_text())
        if match:
            self.keys["local"] = match.group(1)
            self.all_keys.append(match.group(1))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def logs(self) -> str:
        return self.stdout_path.read_text(errors="replace") + self.stderr_path.read_text(errors="replace")

    def logs_without_bootstrap_link(self) -> str:
        """Everything the server wrote, less the one line that shows the bootstrap key on purpose."""
        return "\n".join(line for line in self.logs().splitlines() if not LINK_RE.search(line))

    def health(self) -> dict:
        return httpx.get(f"{self.base}/health", timeout=5).json()

    # ---- tenancy, through the real store on the same database
    def run_store(self, fn):
        from tenancy.store import TenancyStore

        async def go():
            async with TenancyStore(self.database_url) as store:
                return await fn(store)

        return asyncio.run(go())

    def add_tenant(self, name: str, **kwargs) -> str:
        async def fn(store):
            await store.create_tenant(name, **kwargs)
            return (await store.create_key(name))[1]

        key = self.run_store(fn)
        self.keys[name] = key
        self.all_keys.append(key)
        return key

    def add_key(self, tenant: str) -> tuple[str, str]:
        info, key = self.run_store(lambda store: store.create_key(tenant))
        self.all_keys.append(key)
        return info.prefix, key


class ChatClient:
    """A ``websockets`` client that routes server events to per-chat queues."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ready: dict | None = None
        self.chats: dict[str, asyncio.Queue] = {}
        self.other: asyncio.Queue = asyncio.Queue()  # events with no chat id (pong, id-less errors)
        self._reader: asyncio.Task | None = None

    @classmethod
    async def connect(cls, server: GatewayServer, key: str, **kwargs) -> ChatClient:
        ws = await websockets.connect(
            server.ws_url, additional_headers={"Authorization": f"Bearer {key}"},
            subprotocols=["chatgate.v1"], **kwargs,
        )  # fmt: skip
        self = cls(ws)
        self.ready = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert self.ready["type"] == "ready", self.ready
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        async for frame in self.ws:
            event = json.loads(frame)
            chat_id = event.get("id")
            if chat_id is not None:
                self.chats.setdefault(chat_id, asyncio.Queue()).put_nowait(event)
            else:
                self.other.put_nowait(event)

    async def send(self, obj: dict | str) -> None:
        await self.ws.send(obj if isinstance(obj, str) else json.dumps(obj))

    async def create(self, chat_id: str, messages: list[dict], **params) -> None:
        self.chats.setdefault(chat_id, asyncio.Queue())
        await self.send({"type": "chat.create", "id": chat_id, "messages": messages, "params": params})

    async def next_event(self, chat_id: str | None, timeout: float = 120.0) -> dict:
        queue = self.other if chat_id is None else self.chats.setdefault(chat_id, asyncio.Queue())
        return await asyncio.wait_for(queue.get(), timeout)

    async def collect(self, chat_id: str, timeout: float = 300.0) -> tuple[str, dict]:
        """Deltas joined, and the final ``chat.done`` or ``error`` event."""
        parts = []
        while True:
            event = await self.next_event(chat_id, timeout)
            if event["type"] == "chat.delta":
                parts.append(event["text"])
            else:
                return "".join(parts), event

    async def chat(self, chat_id: str, messages: list[dict], **params) -> tuple[str, dict]:
        await self.create(chat_id, messages, **params)
        return await self.collect(chat_id)

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
