"""The synchronous engine core: validate and add requests, then step.

One ``step()`` = schedule -> run the model -> sample -> detokenize -> report.
Everything here runs on one thread; ``engine.async_llm`` drives it off the
event loop, and ``engine.llm.LLM`` drives it to completion for offline use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed import TensorParallelGroup
from engine.errors import EngineDeadError, InvalidRequestError
from engine.dummy_models import build_model
from engine.executor import (TensorParallelExecutor, UniProcExecutor, WorkerSpec,
                             check_tensor_parallel_size)
from engine.model_runner import build_runner, kv_bytes_per_block
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.policy import make_policy
from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import PreemptionCostModel, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Engine options (vLLM's names).

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks: explicit KV pool size in blocks (on any device); None sizes
            it from ``kv_cache_memory_gb`` (CPU) or free memory (CUDA).
        kv_cache_memory_gb: KV pool budget on the CPU when num_gpu_blocks is None.
        gpu_memory_utilization: fraction of free GPU memory given to the KV pool.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest prompt + output, tokens; defaults to the model's.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu``, ``cuda``, ``cuda:N``.
        seed: seeds the draws of requests that have no seed of their own.
        attention_backend: ``auto`` (Triton on CUDA, SDPA on the CPU), ``reference``,
            ``sdpa`` or ``triton``.
        scheduling_policy: see ``engine.policy.POLICIES``.
        enable_chunked_prefill: split long prompts across steps.
        enable_prefix_caching: reuse computed KV blocks across requests.
        shared_prefix_cache: one cache namespace for all tenants (by default the
            salt is the tenant, so tenants never share KV: a shared cache leaks
            prompts through time to first token).
        swap_space_gb: CPU swap pool for preempted requests' blocks (pinned on
            GPU), at most four times the GPU pool's block count.
        preemption_mode: ``swap``, ``recompute`` or ``auto`` (cost model per victim).
        cuda_graphs: replay CUDA graphs for decode-only steps (CUDA devices, tensor_parallel_size 1).
        compile_model: ``torch.compile`` each decoder layer (attention stays the backend's);
            None: on CUDA devices only (measured faster there: BENCHMARKS.md); the
            tensor-parallel collectives stay outside the compiled graphs.
        tensor_parallel_size: ranks the model is split across (``engine.executor``);
            on CUDA, rank ``r`` uses the GPU after ``device`` by ``r``; on the CPU the
            ranks are processes talking over gloo.
        tensor_parallel_timeout_s: how long a rank waits in a collective for a
            peer before the step fails.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"
    scheduling_policy: str = "priority-fair"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    shared_prefix_cache: bool = False
    swap_space_gb: float = 1.0
    preemption_mode: str = "auto"
    cuda_graphs: bool = True
    compile_model: bool | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class LLMEngine:
    """Owns the scheduler, the model runner, the sampler and per-request text state.

    Args:
        model_config: the model's shape.
        state_dict: Hugging Face-named weights, or None for random ("dummy") weights
            drawn directly on the device (``engine.dummy_models``; for benchmarks).
        tokenizer: a Hugging Face tokenizer, or None (then outputs carry ids only).
        config: engine options.
        model_name: reported in stats.
        chat_template: Jinja chat template, if the model has one.

    Raises:
        ValueError: inconsistent options (e.g. max_model_len beyond the model's, a
            tensor_parallel_size that does not divide the heads or exceeds the GPUs).
        EngineDeadError: a tensor-parallel worker failed to start (its error is in
            the message).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor] | None,
        tokenizer=None,
        config: EngineConfig = EngineConfig(),
        model_name: str = "model",
        chat_template: str | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.device = torch.device(config.device)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"{model_config.max_position_embeddings} positions"
            )
        tp_size = config.tensor_parallel_size
        check_tensor_parallel_size(model_config, tp_size, config.device)
        tp = TensorParallelGroup(0, tp_size)  # rank 0's shard; the group forms below
        torch.manual_seed(config.seed)
        model = build_model(model_config, state_dict, self.device, config.torch_dtype, config.seed, tp)
        num_blocks = config.num_gpu_blocks or self._auto_num_blocks(model_config)
        block_bytes = kv_bytes_per_block(model_config, config.block_size, config.torch_dtype, tp_size)
        # More than a few GPU pools' worth of swap space is never used (swapped
        # requests resume before anything new is admitted); the cap keeps tiny
        # models from building millions of block records.
        num_cpu_blocks = min(int(config.swap_space_gb * (1 << 30) // block_bytes), 4 * num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_cpu_blocks, config.enable_prefix_caching)
        self.cost_model = PreemptionCostModel(bytes_per_block=block_bytes)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                            config.preemption_mode),
            self.block_manager,
            make_policy(config.scheduling_policy),
            self.cost_model,
        )
        compile_model = config.compile_model if config.compile_model is not None else self.device.type == "cuda"
        # CUDA graphs only at one rank: replays of graphs that captured torch.distributed's
        # NCCL all-reduces hung on two H200s (BENCHMARKS.md), so TP > 1 steps run eagerly.
        cuda_graphs = config.cuda_graphs and tp_size == 1
        tp_executor = None
        if tp_size > 1:
            if state_dict is not None:
                for t in state_dict.values():
                    t.share_memory_()  # workers map these pages instead of receiving a copy
            tp_executor = TensorParallelExecutor(WorkerSpec(
                model_config, state_dict, config.torch_dtype, config.device, num_blocks, config.block_size,
                num_cpu_blocks, config.attention_backend, config.max_num_seqs, self.max_model_len,
                cuda_graphs, config.seed, config.tensor_parallel_timeout_s, compile_model), tp_size)
        try:
            self.runner = build_runner(model, self.device, config.attention_backend, compile_model, num_blocks,
                                       config.block_size, num_cpu_blocks, max_num_seqs=config.max_num_seqs,
                                       max_model_len=self.max_model_len, cuda_graphs=cuda_graphs)
        except BaseException:
            if tp_executor is not None:
                tp_executor.shutdown()
            raise
        if tp_executor is not None:
            tp_executor.wait_ready(self.runner)
        self.executor = tp_executor or UniProcExecutor(self.runner)
        if num_cpu_blocks:
            self.cost_model.copy_bandwidth = self._measure_copy_bandwidth()
        generator = torch.Generator().manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.eos_token_ids = tuple(model_config.eos_token_ids)

    def _auto_num_blocks(self, mc: ModelConfig) -> int:
        per_block = kv_bytes_per_block(mc, self.config.block_size, self.config.torch_dtype,
                                       self.config.tensor_parallel_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.gpu_memory_utilization - (1 << 30)  # headroom for activations
        else:
            budget = self.config.kv_cache_memory_gb * (1 << 30)
        return max(1, int(budget // per_block))

    def _measure_copy_bandwidth(self) -> float:
        """Bytes/s of a batched swap-out copy of a few blocks (both K and V, all layers)."""
        n = min(8, self.block_manager.num_blocks, self.block_manager.cpu.num_blocks)
        mapping = [(i, i) for i in range(n)]
        self.runner.swap(mapping, [])  # warm-up
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.runner.swap(mapping, [])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n * self.cost_model.bytes_per_block / max(time.perf_counter() - t0, 1e-9)

    # -- requests -------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        tenant_id: str | None = None,
        priority: int = 1,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        weight: float = 1.0,
    ) -> Request:
        """Validate and queue a request.

        Raises:
            InvalidRequestError: a duplicate id, or anything ``validate`` refuses.
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", code="duplicate_id")
        if not weight > 0:
            raise InvalidRequestError(f"weight must be > 0, got {weight}", code="invalid_parameter")
        self.validate(prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            tenant_id=tenant_id,
            priority=priority,
            cache_salt=self._salt(tenant_id, cache_salt),
            weight=weight,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            **({"arrival_time": arrival_time} if arrival_time is not None else {}),
        )
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop)
        self.scheduler.add_request(request)
        return request

    def _salt(self, tenant_id: str | None, cache_salt: str | None) -> str | None:
        if cache_salt is not None:
            return cache_salt
        return None if self.config.shared_prefix_cache else tenant_id

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check a request without queueing it.

        Raises:
            InvalidRequestError: empty or too-long prompt, token ids outside the
                vocabulary, bad params, or a request that could never fit in the KV
                pool (refused now rather than waiting forever).
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", code="invalid_parameter")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", code="empty_prompt")
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", code="invalid_token")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate",
                code="prompt_too_long",
            )
        worst = min(n + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_needed(worst) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{self.block_manager.blocks_needed(worst)} KV blocks; the pool has "
                f"{self.block_manager.num_blocks}",
                code="exceeds_kv_capacity",
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks; None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return self._finish_output(request, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of requests that progressed or finished."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampling = [p.request for p in plan.scheduled if p.samples]
        try:
            t0 = time.perf_counter()
            logits = self.executor.execute_model(plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.scheduled)
            if not plan.scheduled:
                return []
            self.scheduler.update_after_step(plan)
            sampled = self.sampler(logits, sampling)
            self._observe_step(plan.num_batched_tokens, time.perf_counter() - t0)
        except EngineDeadError:
            raise  # nothing can run any more; the caller fails every request
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("engine step failed")
            outputs = []
            for p in plan.scheduled:
                self.scheduler.finish_request(p.request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._finish_output(p.request, [], error=f"{type(exc).__name__}: {exc}"))
            return outputs
        now = time.monotonic()
        outputs = []
        for request, token_id, logprob in zip(sampling, sampled.token_ids, sampled.logprobs):
            outputs.append(self._advance(request, token_id, logprob, now))
        return outputs

    def dead_reason(self) -> str | None:
        """None while the engine can step; else why not (a tensor-parallel worker died, or shutdown)."""
        return self.executor.dead_reason()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (idempotent; the engine cannot step afterwards at TP > 1)."""
        self.executor.shutdown()

    def _observe_step(self, num_tokens: int, seconds: float) -> None:
        """Keep the cost model's prefill rate (tokens/s) measured on prefill-sized steps."""
        if num_tokens >= 64:
            rate = num_tokens / max(seconds, 1e-9)
            self.cost_model.prefill_rate = 0.8 * self.cost_model.prefill_rate + 0.2 * rate

    def _advance(self, request: Request, token_id: int, logprob, now: float) -> RequestOutput:
        request.append_output_token(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        if logprob is not None:
            if request.logprobs is None:
                request.logprobs = []
            request.logprobs.append(logprob)
        status = request.check_stop_token()
        detok = self.detokenizers.get(request.request_id)
        if detok is not None and detok.add_token(token_id):
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = detok.stopped_by
        if status is not None:
            self.scheduler.finish_request(request, status)
            return self._finish_output(request, [token_id])
        return self._make_output(request, [token_id], finished=False)

    # -- outputs -----------------------------------------------------------------
    def _finish_output(self, request: Request, delta_ids: list[int], error: str | None = None) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        out = self._make_output(request, delta_ids, finished=True, error=error)
        self.detokenizers.pop(request.request_id, None)
        return out

    def _make_output(self, request: Request, delta_ids: list[int], finished: bool, error: str | None = None) -> RequestOutput:
        detok = self.detokenizers.get(request.request_id)
        delta_text = detok.take_delta(finished) if detok else ""
        text = detok.output_text[: detok.emitted] if detok else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=request.output_token_ids,
            finish_reason=request.status.finish_reason if finished else None,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            logprobs=request.logprobs,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics(request.arrival_time, request.first_token_time, request.finished_time,
                                   request.first_scheduled_time),
            error=error,
            num_cached_tokens=request.num_cached_tokens,
        )

    # -- introspection -------------------------------------------------------------
    def stats(self) -> dict:
        """Queue lengths and KV pool use (counts of requests and blocks)."""
        s, bm = self.scheduler, self.block_manager
        return {
            "model": self.model_name,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            "num_preemptions": s.num_preemptions,
            "num_swapped_out_blocks": bm.num_swapped_out_blocks,
            "num_swapped_in_blocks": bm.num_swapped_in_blocks,
            "prefix_cache_queried_tokens": bm.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": bm.prefix_cache_hit_tokens,
            "free_gpu_blocks": bm.num_free_blocks,
            "total_gpu_blocks": bm.num_blocks,
            "free_cpu_blocks": bm.num_free_cpu_blocks,
            "total_cpu_blocks": bm.cpu.num_blocks,
        }
