"""The engine client for async servers: the core loop runs on its own thread.

``generate`` is an async iterator of ``RequestOutput`` deltas; nothing on the
event loop ever waits on model work. Commands (add, abort) cross to the engine
thread through a queue; outputs come back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm import encode_chat, load_engine
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant_id: str | None
    priority: int
    cache_salt: str | None
    weight: float
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


class AsyncLLM:
    """Async client over an ``LLMEngine`` driven by a background thread.

    Args:
        model: as for ``engine.LLM``.
        **engine_kwargs: ``EngineConfig`` fields.

    Raises:
        engine.loader.ModelLoadError, ValueError: as for ``engine.LLM``.
    """

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **engine_kwargs) -> None:
        if engine is None:
            if model is None:
                raise ValueError("give a model name or an engine")
            engine = load_engine(model, **engine_kwargs)
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stats = engine.stats()
        self._stopped = threading.Event()
        self._state_lock = threading.Lock()  # orders "check stopped, queue a command" against the thread's exit
        self._dead_reason: str | None = None  # why the engine thread stopped, if it did on its own
        self._thread = threading.Thread(target=self._run, name="chatgate-engine", daemon=True)
        self._thread.start()

    # -- properties used by gateways ------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """False once the engine cannot serve: its thread stopped, or a tensor-parallel
        worker died (seen at once, even while idle); ``dead_reason`` says why."""
        return not self._stopped.is_set() and self.engine.dead_reason() is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        return self._dead_reason or self.engine.dead_reason()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Chat messages -> prompt token ids. Raises InvalidRequestError on bad messages."""
        return encode_chat(self.engine, messages)

    def stats(self) -> dict:
        """A snapshot of the engine's counters, refreshed after every step."""
        return dict(self._stats)

    # -- requests -----------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        tenant_id: str | None = None,
        priority: int = 1,
        cache_salt: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; the last one has ``finished`` set.

        Raises:
            InvalidRequestError: before the first output, for a request the engine refuses.
            EngineDeadError: the engine thread has stopped.

        Closing the iterator early (``break``, task cancellation) aborts the request.
        """
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        with self._state_lock:  # against the engine thread's exit: a command is queued only while it runs
            if self._stopped.is_set():
                raise EngineDeadError(self._dead_reason or "the engine has stopped")
            self._commands.put(_Add(request_id, list(prompt_token_ids), params, tenant_id, priority, cache_salt,
                                    weight, sink, loop, accepted))
        await accepted
        finished = False
        try:
            while True:
                out = await sink.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are freed on the engine thread's next turn."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with an error."""
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout)
        self.engine.shutdown()

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                block = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
                elif (reason := self.engine.dead_reason()) is not None and not self._stopped.is_set():
                    raise EngineDeadError(reason)  # a worker died while idle: stop now, not at the next request
                self._stats = self.engine.stats()
        except EngineDeadError as exc:  # e.g. a tensor-parallel worker died: reported, not re-raised
            logger.error("engine stopped: %s", exc)
            self._dead_reason = str(exc)
            self.engine.shutdown()  # the other workers, if any
            for rid in list(self._sinks):
                self._deliver_error(rid, exc)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then re-raised
            logger.exception("engine thread died")
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            for rid in list(self._sinks):
                self._deliver_error(rid, EngineDeadError(f"engine stopped: {exc}"))
            raise
        finally:
            with self._state_lock:
                self._stopped.set()
                pending = []
                while True:
                    try:
                        pending.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
            gone = EngineDeadError(self._dead_reason or "the engine has stopped")
            for cmd in pending:  # requests queued while the thread was ending: refused, not left waiting
                if isinstance(cmd, _Add):
                    with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                        cmd.loop.call_soon_threadsafe(_set_exception, cmd.accepted, gone)
            for rid in list(self._sinks):
                self._deliver_error(rid, EngineDeadError("the engine has stopped"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False means shut down."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            out = self.engine.abort_request(cmd.request_id)
            if out is not None:
                self._deliver(out)
            return
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt_token_ids, cmd.params,
                tenant_id=cmd.tenant_id, priority=cmd.priority, cache_salt=cmd.cache_salt, weight=cmd.weight,
            )
        except InvalidRequestError as exc:
            cmd.loop.call_soon_threadsafe(_set_exception, cmd.accepted, exc)
            return
        self._sinks[cmd.request_id] = (cmd.sink, cmd.loop)
        cmd.loop.call_soon_threadsafe(_set_result, cmd.accepted, None)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._sinks.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        sink, loop = entry
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        sink, loop = self._sinks.pop(request_id)
        try:
            loop.call_soon_threadsafe(sink.put_nowait, exc)
        except RuntimeError:
            pass


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
