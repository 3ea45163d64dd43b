"""OpenAI-compatible HTTP endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Same tenants, keys (``Authorization: Bearer``) and quotas as the WebSocket: every
request runs through ``app.chat_service.ChatService``. Answers follow OpenAI's
shapes (chunks as server-sent events, ``data: [DONE]`` last; errors as
``{"error": {"message", "type", "param", "code"}}``) so the official ``openai``
package works unchanged:

=====================================  ======  ==========================================
refusal                                status  ``error.code`` (``openai`` exception)
=====================================  ======  ==========================================
no, unknown, revoked key               401     ``invalid_api_key`` (AuthenticationError)
priority class not allowed             403     ``priority_not_allowed`` (PermissionDeniedError)
unknown model                          404     ``model_not_found`` (NotFoundError)
bad JSON or parameter                  400     ``invalid_value`` / ... (BadRequestError)
prompt fills the context               400     ``context_length_exceeded``
rate quota (per minute, concurrency)   429     ``rate_limit_exceeded`` + ``Retry-After``
used-up budget (day, month)            429     ``insufficient_quota``, ``x-should-retry: false``
tenancy store or engine down           503     ``service_unavailable``
=====================================  ======  ==========================================

A client that goes away aborts its request in the engine: a streaming response is
cancelled by Starlette on ``http.disconnect``; a non-streaming one is raced
against the disconnect here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.chat_service import ChatService, PriorityNotAllowedError, QuotaExceededError
from app.logging_setup import bind_request_id
from app.openai_protocol import ChatCompletionRequest, CompletionRequest, ResponseFormatter, error_body, now_s
from engine import EngineDeadError, InvalidRequestError, SamplingParams
from tenancy.errors import StoreUnavailableError

log = logging.getLogger("chatgate.openai")

MAX_BODY_BYTES = 4 * 1024 * 1024
# Which x-ratelimit-* family a quota belongs to (OpenAI sends -requests and -tokens).
_QUOTA_FAMILY = {"requests_per_minute": "requests", "tokens_per_minute": "tokens", "tokens_per_day": "tokens",
                 "tokens_per_month": "tokens", "max_concurrent_chats": "concurrent-requests"}  # fmt: skip


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.code, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
    ]


# ---------------------------------------------------------------- endpoints


async def list_models(request: Request) -> Response:
    try:
        await _authenticate(request)
    except ApiError as exc:
        return exc.response()
    llm = request.app.state.llm
    card = {"id": llm.model_name, "object": "model", "created": now_s(), "owned_by": "chatgate",
            "max_model_len": llm.max_model_len}  # fmt: skip
    return JSONResponse({"object": "list", "data": [card]})


async def chat_completions(request: Request) -> Response:
    try:
        principal = await _authenticate(request)
        body = await _parse(request, ChatCompletionRequest)
        llm = request.app.state.llm
        _check_model(body.model, llm)
        if body.logprobs or body.top_logprobs:
            raise ApiError(400, "logprobs are not supported yet", "invalid_request_error", "unsupported", "logprobs")
        prompt_ids = _chat_prompt(llm, [m.plain() for m in body.messages])
        return await _serve(request, principal, body, prompt_ids, f"chatcmpl-{uuid.uuid4().hex}", chat=True)
    except ApiError as exc:
        return exc.response()


async def completions(request: Request) -> Response:
    try:
        principal = await _authenticate(request)
        body = await _parse(request, CompletionRequest)
        llm = request.app.state.llm
        _check_model(body.model, llm)
        if body.logprobs:
            raise ApiError(400, "logprobs are not supported yet", "invalid_request_error", "unsupported", "logprobs")
        prompt_ids = _text_prompt(llm, body.prompt)
        return await _serve(request, principal, body, prompt_ids, f"cmpl-{uuid.uuid4().hex}", chat=False)
    except ApiError as exc:
        return exc.response()


async def _serve(request: Request, principal: Any, body: Any, prompt_ids: list[int], request_id: str,
                 *, chat: bool) -> Response:  # fmt: skip
    """Start the request through the chat service, then answer as a stream or as one object."""
    state = request.app.state
    bind_request_id(request_id)
    params = _sampling_params(body, len(prompt_ids), state.llm.max_model_len)
    stream = _chat_service(request).run(principal, request_id, prompt_ids, params, body.priority)
    # Refusals (quota, priority, store) raise from the first __anext__: wait for it
    # before any header goes out, so they can still be a 429/403/503.
    try:
        first = await _until_disconnected(request, _first(stream))
    except ClientGone:
        await stream.aclose()
        return Response(status_code=499)
    except BaseException as exc:
        await stream.aclose()
        if isinstance(exc, Exception):
            raise _api_error(exc) from None
        raise
    fmt = ResponseFormatter(request_id, state.llm.model_name, len(prompt_ids), chat)
    headers = {"x-request-id": request_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(fmt, first, stream, include_usage)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})  # fmt: skip
    try:
        last = await _until_disconnected(request, _drain(first, stream))
    except ClientGone:
        return Response(status_code=499)
    except EngineDeadError as exc:  # the engine stopped mid-request (e.g. a tensor-parallel worker died)
        raise _api_error(exc) from None
    finally:
        await stream.aclose()
    if last.outputs[0].finish_reason == "error":
        raise ApiError(500, "the engine failed on this request", "server_error", "engine_error")
    return JSONResponse(fmt.whole(last), headers=headers)


# ---------------------------------------------------------------- request handling


async def _authenticate(request: Request) -> Any:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                       "invalid_request_error", "invalid_api_key")  # fmt: skip
    state = request.app.state
    try:
        principal = await state.store.authenticate(key.strip())
    except StoreUnavailableError:
        log.error("openai auth failed: tenancy store unavailable")
        raise ApiError(503, "The authentication store is unavailable; try again later.", "server_error",
                       "service_unavailable") from None  # fmt: skip
    if principal is None:
        raise ApiError(401, "Incorrect API key provided (unknown, revoked, or tenant disabled).",
                       "invalid_request_error", "invalid_api_key")  # fmt: skip
    metrics = getattr(state, "metrics", None)
    if metrics is not None:
        metrics.note_tenant(principal.tenant_id, principal.tenant_name)
    return principal


async def _parse(request: Request, model: type) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error", "body_too_large")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}",
                       "invalid_request_error", "invalid_json") from None  # fmt: skip
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request_error", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        kind = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
        text = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                         for e in exc.errors(include_url=False, include_input=False))  # fmt: skip
        raise ApiError(400, text, "invalid_request_error", kind, param) from None


def _check_model(name: str, llm: Any) -> None:
    if name != llm.model_name:
        raise ApiError(404, f"The model `{name}` does not exist. This server serves `{llm.model_name}`.",
                       "invalid_request_error", "model_not_found", "model")  # fmt: skip


def _chat_prompt(llm: Any, messages: list[dict]) -> list[int]:
    try:
        return llm.apply_chat_template(messages)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", exc.code, "messages") from None
    except Exception as exc:  # noqa: BLE001 - e.g. a template that rejects the role order
        raise ApiError(400, f"the chat template refused the messages: {exc}", "invalid_request_error",
                       "invalid_value", "messages") from None  # fmt: skip


def _text_prompt(llm: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(llm.tokenizer.encode(prompt))
    vocab = len(llm.tokenizer)
    if any(t < 0 or t >= vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "invalid_request_error", "invalid_value",
                       "prompt")  # fmt: skip
    return list(prompt)


def _sampling_params(body: Any, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """OpenAI fields to engine params; ``max_tokens`` capped to the room left in the context."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt is {num_prompt_tokens} tokens, leaving no room for an answer.",
                       "invalid_request_error", "context_length_exceeded",
                       "messages" if hasattr(body, "messages") else "prompt")  # fmt: skip
    wanted = body.requested_max_tokens()
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=body.min_p or 0.0,
            max_tokens=room if wanted is None else min(wanted, room),
            stop=body.stop_list(), seed=body.seed, ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty or 1.0,
        )  # fmt: skip
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", "invalid_value") from None


def _chat_service(request: Request) -> ChatService:
    state = request.app.state
    service = getattr(state, "chat_service", None)
    if service is None:  # the app builds one at startup; this covers apps built without it
        service = state.chat_service = ChatService(state.llm, state.store, state.settings)
    return service


def _api_error(exc: Exception) -> ApiError:
    """A refusal from the chat service or the engine, as OpenAI would answer it."""
    if isinstance(exc, QuotaExceededError):
        return _quota_error(exc)
    if isinstance(exc, PriorityNotAllowedError):
        return ApiError(403, str(exc), "permission_error", "priority_not_allowed", "priority")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), "invalid_request_error", exc.code)
    if isinstance(exc, StoreUnavailableError):
        return ApiError(503, "The quota store is unavailable; try again later.", "server_error", "service_unavailable")
    log.error("request refused by the engine: %s: %s", type(exc).__name__, exc)
    return ApiError(503, "The engine is unavailable.", "server_error", "service_unavailable")


def _quota_error(exc: QuotaExceededError) -> ApiError:
    family = _QUOTA_FAMILY.get(exc.quota_name, exc.quota_name)
    headers = {f"x-ratelimit-limit-{family}": str(exc.limit), f"x-ratelimit-remaining-{family}": "0"}
    if exc.retry_after_s is not None:
        wait = max(1, math.ceil(exc.retry_after_s))
        headers |= {"retry-after": str(wait), "retry-after-ms": str(math.ceil(exc.retry_after_s * 1000)),
                    f"x-ratelimit-reset-{family}": f"{exc.retry_after_s:.3f}s"}  # fmt: skip
    if not exc.retryable:
        headers["x-should-retry"] = "false"  # the openai package honours this
        return ApiError(429, f"You exceeded your quota ({exc}); it does not come back by retrying now.",
                        "insufficient_quota", "insufficient_quota", headers=headers)  # fmt: skip
    return ApiError(429, f"Rate limit reached: {exc}", family, "rate_limit_exceeded", headers=headers)


# ---------------------------------------------------------------- streaming and disconnects


async def _first(stream: AsyncIterator[Any]) -> Any:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _drain(first: Any, stream: AsyncIterator[Any]) -> Any:
    last = first
    if first is not None and not first.finished:
        async for out in stream:
            last = out
    return last


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            log.info("client disconnected; request aborted")
            raise ClientGone()
    return task.result()


async def _sse(fmt: ResponseFormatter, first: Any, stream: AsyncIterator[Any], include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: role chunk, content chunks, finish chunk, usage chunk, ``[DONE]``.

    Starlette cancels this generator when the client disconnects; closing the
    chat-service stream then aborts the request in the engine and settles its quota.
    """
    last = first
    try:
        if fmt.chat:
            yield fmt.event(fmt.chunk({"role": "assistant", "content": ""}, None, include_usage))
        out = first
        while out is not None:
            last = out
            text = out.outputs[0].delta_text
            if text:
                yield fmt.event(fmt.chunk({"content": text} if fmt.chat else text, None, include_usage))
            try:
                out = None if out.finished else await _first(stream)
            except EngineDeadError as exc:
                log.error("request stopped: the engine has stopped: %s", exc)
                yield fmt.event(error_body("The engine is unavailable.", "server_error", "service_unavailable"))
                yield "data: [DONE]\n\n"
                return
        reason = last.outputs[0].finish_reason if last is not None else "abort"
        if reason == "error":
            yield fmt.event(error_body("the engine failed on this request", "server_error", "engine_error"))
        else:
            yield fmt.event(fmt.chunk({} if fmt.chat else "", reason, include_usage))
            if include_usage:
                yield fmt.event(fmt.usage_chunk(last))
        yield "data: [DONE]\n\n"
    finally:
        # Shielded: Starlette cancels this generator's scope on disconnect, and the
        # close (engine abort, quota settlement) must run to its end regardless.
        await asyncio.shield(asyncio.ensure_future(stream.aclose()))
