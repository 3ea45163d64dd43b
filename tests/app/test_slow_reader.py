"""A client that stops reading: the bounded send queue overflows, the socket closes with 1008,
and its chats are aborted in the (real) engine; memory never grows past the queue bound."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from app.ws import CLOSE_POLICY, ChatSession
from tenancy.records import Principal

QUEUE_SIZE = 8


class StalledSocket:
    """The ASGI side of a socket whose peer stopped reading: every send blocks forever."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.sends_started = 0
        self.closed: tuple[int, str] | None = None

    async def send_text(self, text: str) -> None:
        self.sends_started += 1
        await asyncio.Event().wait()

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


def test_slow_reader_overflows_its_queue_and_is_closed_with_1008(stories_path):
    from engine import AsyncLLM

    llm = AsyncLLM("stories260k", max_model_len=256)
    principal = Principal(
        tenant_id=1, tenant_name="slow", key_id=1, key_prefix="cg_slowslow", weight=1.0,
        allowed_priorities=frozenset({"standard"}),
    )  # fmt: skip
    settings = SimpleNamespace(ws_max_message_bytes=65536, ws_send_queue_size=QUEUE_SIZE)

    async def main():
        ws = StalledSocket()
        session = ChatSession(ws, llm, principal, settings)
        for i in range(4):
            frame = {"type": "chat.create", "id": f"c{i}", "messages": [{"role": "user", "content": "Once"}],
                     "params": {"temperature": 0, "max_tokens": 200}}  # fmt: skip
            ws.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(frame)})
        await asyncio.wait_for(session.run(), 30)
        assert session._queue.qsize() <= QUEUE_SIZE
        return ws

    try:
        ws = asyncio.run(main())
        assert ws.closed is not None and ws.closed[0] == CLOSE_POLICY and "send queue full" in ws.closed[1]
        assert ws.sends_started == 1  # the writer stalled on its first frame
        # Every chat of the socket was aborted: nothing runs, every KV block is free.
        for _ in range(50):
            stats = llm.stats()
            if stats["num_running"] == 0 and stats["free_gpu_blocks"] == stats["total_gpu_blocks"]:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["free_gpu_blocks"] == stats["total_gpu_blocks"]
    finally:
        llm.shutdown()
