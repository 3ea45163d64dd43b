"""Run the model on one rank or on a tensor-parallel group of processes.

``UniProcExecutor`` wraps the process's own ``ModelRunner``.

``TensorParallelExecutor`` is the multi-process layout of vLLM's multiprocessing
executor: one process per rank; the engine's process is rank 0 and runs the one
scheduler; ranks 1..N-1 are worker processes (spawned, not forked: the parent
has threads and possibly CUDA state). Each step rank 0 flattens the scheduler's
plan into a ``StepInput`` (token ids, positions, slot mapping, block tables, ...)
and sends it, with the step's swap lists, down a pipe to every worker; then all
ranks run the same forward pass, meeting in the all-reduces of the row-parallel
layers and the all-gather of the logits. Only rank 0 samples. Every rank owns
its share of the KV heads in a paged cache of the same geometry, so one block
table serves all of them.

Failure is loud, never a hang: a worker that cannot start reports its traceback
before it exits; a worker that dies makes the next step (or the one in flight,
whose collective loses its peer) raise ``EngineDeadError`` naming the rank and
exit code, after which the engine refuses to step. Collectives also time out
(``timeout_s``) for a peer that hangs without dying. A worker whose parent goes
away sees its pipe close and exits.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import threading
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

from engine.config import ModelConfig
from engine.distributed import TensorParallelGroup, destroy_tensor_parallel, init_tensor_parallel
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard and its runner (picklable).

    Attributes:
        model_config: the full model's shape.
        state_dict: full-size HF-named CPU tensors (shared memory), or None for
            dummy weights drawn with ``seed + rank``.
        dtype: torch dtype of weights and KV cache.
        device: rank 0's device (``cpu`` or ``cuda[:i]``); rank ``r`` uses ``cuda:(i + r)``.
        num_blocks, block_size, num_cpu_blocks: KV pool geometry (equal on all ranks).
        attention_backend: backend name for ``make_attention_backend``.
        max_num_seqs, max_model_len, cuda_graphs: as for ``ModelRunner``.
        seed: the engine's seed.
        timeout_s: collective timeout.
        compile_model: ``torch.compile`` the decoder layers, as rank 0 does.
    """

    model_config: ModelConfig
    state_dict: dict[str, torch.Tensor] | None
    dtype: torch.dtype
    device: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    attention_backend: str
    max_num_seqs: int
    max_model_len: int
    cuda_graphs: bool
    seed: int
    timeout_s: float
    compile_model: bool = False


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank`` when rank 0 uses ``device``: ``cuda:(i + rank)``, or the CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def check_tensor_parallel_size(config: ModelConfig, size: int, device: str) -> None:
    """Refuse a tensor-parallel size the model or the machine cannot take.

    Raises:
        ValueError: size < 1; size does not divide the query heads, the KV heads or
            the MLP width; or, on CUDA, rank 0's GPU plus ``size - 1`` more exceed
            the GPUs present.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    for value, what in ((config.num_attention_heads, "num_attention_heads"),
                        (config.num_key_value_heads, "num_key_value_heads"),
                        (config.intermediate_size, "intermediate_size")):
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {what} ({value})")
    d = torch.device(device)
    if d.type == "cuda":
        present = torch.cuda.device_count()
        if (d.index or 0) + size > present:
            raise ValueError(f"tensor_parallel_size {size} needs GPUs {d.index or 0}..{(d.index or 0) + size - 1}; "
                             f"{present} present")


# Why a worker may die before its first message: spawn re-imports the parent's main module.
_SPAWN_HINT = (" before it could report (its traceback is on stderr). Workers are spawned, which "
               "re-imports the main script: a script that starts a tensor-parallel engine at import "
               "time must do so under `if __name__ == \"__main__\":`")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_runner(spec: WorkerSpec, rank: int, world_size: int):
    """Worker side: this rank's model shard and runner (rank 0 builds its own the same way in ``LLMEngine``)."""
    from engine.dummy_models import build_model
    from engine.model_runner import build_runner

    device = rank_device(spec.device, rank)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model_config, spec.state_dict, device, spec.dtype, spec.seed + rank,
                        TensorParallelGroup(rank, world_size))
    return build_runner(model, device, spec.attention_backend, spec.compile_model, spec.num_blocks,
                        spec.block_size, spec.num_cpu_blocks, max_num_seqs=spec.max_num_seqs,
                        max_model_len=spec.max_model_len, cuda_graphs=spec.cuda_graphs)


def _worker_main(rank: int, world_size: int, init_method: str, spec: WorkerSpec, conn: Connection) -> None:
    """A worker process: join the group, build the shard, then follow rank 0's steps until told to stop.

    ``kill -USR1`` on a worker prints every thread's stack to its stderr (a hung collective shows where).
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        conn.send(("started", os.getpid()))  # imports and arguments are fine; joining the group next
        device = rank_device(spec.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        init_tensor_parallel(rank, world_size, init_method, "nccl" if device.type == "cuda" else "gloo",
                             spec.timeout_s)
        runner = _build_runner(spec, rank, world_size)
        conn.send(("ready", None))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if msg[0] == "shutdown":
                return
            _, blocks_to_swap_out, blocks_to_swap_in, step = msg
            runner.swap(blocks_to_swap_out, blocks_to_swap_in)
            if step is not None:
                runner.execute_step(step)
    except BaseException:  # noqa: BLE001 - told to rank 0, then the process exits non-zero
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        raise SystemExit(1)
    finally:
        destroy_tensor_parallel()


class UniProcExecutor:
    """The model on this process only (tensor_parallel_size 1)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def execute_model(self, blocks_to_swap_out, blocks_to_swap_in, plans):
        """Swap, then run ``plans`` (if any); returns their sampling rows' logits or None."""
        self.runner.swap(blocks_to_swap_out, blocks_to_swap_in)
        return self.runner.execute(plans) if plans else None

    def dead_reason(self) -> str | None:
        return None

    def shutdown(self) -> None:
        pass


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group plus its ``world_size - 1`` worker processes.

    Start-up happens in two halves, because building a runner may run collectives
    (warm-up, graph capture) that every rank must run together: the constructor
    spawns the workers, waits until each has started, and joins the group with
    them; the engine then builds rank 0's runner while the workers build theirs;
    ``wait_ready`` waits for the workers to report theirs built.

    Args:
        spec: what each worker builds.
        world_size: the tensor-parallel size (>= 2).

    Raises:
        EngineDeadError: a worker failed to start (its traceback is in the message).
    """

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        if torch.distributed.is_initialized():
            raise EngineDeadError("this process already runs a tensor-parallel engine (or another "
                                  "torch.distributed group); shut it down first (LLM.shutdown())")
        self.world_size = world_size
        self.runner = None
        self._dead: str | None = None
        self._group_state = {"joined": False}  # whether this process joined the group (and must leave it)
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        for rank in range(1, world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, init_method, spec, child),
                               name=f"chatgate-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        weakref.finalize(self, _stop_group, self.procs, self.conns, self._group_state, 5.0)
        # Every worker must be alive and about to join before rank 0 blocks in the
        # rendezvous, which would otherwise wait out the whole timeout for a worker
        # that died on start-up.
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            msg = self._recv(rank, proc, conn, spec.timeout_s, _SPAWN_HINT)
            if msg[0] != "started":
                self.shutdown()
                raise EngineDeadError(f"tensor-parallel worker rank {rank} failed to start: {msg[1]}")
        device = rank_device(spec.device, 0)
        try:
            init_tensor_parallel(0, world_size, init_method, "nccl" if device.type == "cuda" else "gloo",
                                 spec.timeout_s)
            self._group_state["joined"] = True
        except BaseException as exc:
            self.shutdown()
            raise EngineDeadError(f"tensor-parallel group did not form: {self._worker_failures() or exc}") from exc

    def wait_ready(self, runner, timeout_s: float = 600.0) -> None:
        """Adopt rank 0's runner and wait until every worker has built its shard.

        Raises:
            EngineDeadError: a worker reported an error or exited first.
        """
        self.runner = runner
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            msg = self._recv(rank, proc, conn, timeout_s)
            if msg[0] != "ready":
                self.shutdown()
                raise EngineDeadError(f"tensor-parallel worker rank {rank} failed to start:\n{msg[1]}")

    def _recv(self, rank: int, proc, conn: Connection, timeout_s: float, hint: str = ""):
        """One message from a worker, or ``("error", why)`` if it dies or stays silent."""
        waited = 0.0
        while not conn.poll(0.5):
            waited += 0.5
            if not proc.is_alive():
                return ("error", f"the process exited with code {proc.exitcode}{hint}")
            if waited >= timeout_s:
                return ("error", f"no answer after {timeout_s:.0f} s")
        try:
            return conn.recv()
        except EOFError:
            proc.join(5)
            return ("error", f"the process exited with code {proc.exitcode}{hint}")

    def _worker_failures(self) -> str:
        """Why workers are gone, from their exit codes and any traceback they sent."""
        why = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if proc.is_alive():
                continue
            detail = ""
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        detail = ": " + msg[1].strip().splitlines()[-1]
            except (EOFError, OSError):
                pass
            why.append(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}{detail}")
        return "; ".join(why)

    def _fail(self, cause: BaseException | None) -> EngineDeadError:
        """Mark the group dead, stop what is left of it, and say why."""
        for proc in self.procs:  # a worker killed mid-step takes a moment to be reaped
            proc.join(2 if cause is not None else 0)
        reason = self._worker_failures() or f"tensor-parallel step failed: {type(cause).__name__}: {cause}"
        self._dead = reason
        logger.error("tensor-parallel group is dead: %s", reason)
        self.shutdown()
        return EngineDeadError(reason)

    def dead_reason(self) -> str | None:
        """None while every worker lives; else why the group is dead.

        Cheap (a ``waitpid`` per worker) and side-effect free, so any thread may ask;
        the engine thread fails the group at its next step.
        """
        if self._dead is not None:
            return self._dead
        dead = [f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        return "; ".join(dead) or None

    def execute_model(self, blocks_to_swap_out, blocks_to_swap_in, plans):
        """Send the step to every worker, run rank 0's share, return rank 0's logits (or None).

        Raises:
            EngineDeadError: the group has lost a rank (now or earlier); the engine
                cannot step any more.
        """
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if any(not p.is_alive() for p in self.procs):
                raise self._fail(None)
            step = self.runner.build_step_input(plans) if plans else None
            try:
                for conn in self.conns:
                    conn.send(("step", blocks_to_swap_out, blocks_to_swap_in, step))
                self.runner.swap(blocks_to_swap_out, blocks_to_swap_in)
                return self.runner.execute_step(step) if step is not None else None
            except Exception as exc:  # a rank that fails mid-step leaves the others' collectives unmatched
                raise self._fail(exc) from exc

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (asking first, then SIGTERM, then SIGKILL) and leave the group. Idempotent."""
        if self._dead is None:
            self._dead = "the engine has been shut down"
        _stop_group(self.procs, self.conns, self._group_state, timeout_s)


def _stop_group(procs: list, conns: list, group_state: dict, timeout_s: float) -> None:
    """``TensorParallelExecutor.shutdown``'s work, also run by its finalizer when an engine is
    dropped without ``shutdown`` (so the process can start another one). Empties both lists."""
    for conn in conns:
        try:
            conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    conns.clear()
    procs.clear()
    if group_state.get("joined"):
        group_state["joined"] = False
        destroy_tensor_parallel()
