"""Pydantic models of the OpenAI-compatible API (``/v1/chat/completions``, ``/v1/completions``).

Field names, defaults and ranges follow OpenAI's API reference; vLLM's sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``) and chatgate's
``priority`` class are accepted too (the ``openai`` package sends them through
``extra_body``). Fields OpenAI defines that chatgate cannot honour (``n > 1``,
tools, ``logit_bias``...) are refused with a 400 naming the field rather than
silently ignored; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.protocol import Priority


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One turn; ``developer`` is OpenAI's newer name for ``system``. Content may be text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(_Request):
    include_usage: bool = False


Stop = Union[Annotated[str, Field(min_length=1)], list[Annotated[str, Field(min_length=1)]], None]


class _Sampling(_Request):
    """Parameters shared by chat and text completions (OpenAI defaults)."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    # chatgate extension: the priority class (must be one the tenant may use)
    priority: Priority | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Stop) -> Stop:
        if isinstance(value, list) and len(value) > 8:
            raise ValueError("at most 8 stop sequences")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _refuse_logit_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _refuse_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tools (function calling) are not supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _refuse_formats(cls, value: dict | None) -> dict | None:
        if value and value.get("type") not in (None, "text"):
            raise ValueError("only response_format {'type': 'text'} is supported")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (legacy text completion): one prompt, text or token ids."""

    prompt: Annotated[str, Field(min_length=1)] | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _refuse_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# ---------------------------------------------------------------- responses (plain dicts: cheap per chunk)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now_s() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ResponseFormatter:
    """OpenAI's JSON for one request: chunks while streaming, one object otherwise."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int, chat: bool) -> None:
        self.id, self.model, self.num_prompt_tokens, self.chat = request_id, model, num_prompt_tokens, chat
        self.created = now_s()
        self.object = "chat.completion" if chat else "text_completion"

    @staticmethod
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: dict | str, finish_reason: str | None, include_usage: bool) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, last: Any) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self._usage(last)}

    def _usage(self, last: Any) -> dict:
        return usage(self.num_prompt_tokens, len(last.outputs[0].token_ids) if last is not None else 0)

    def whole(self, last: Any) -> dict:
        completion = last.outputs[0]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                      "logprobs": None, "finish_reason": completion.finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": completion.text, "logprobs": None, "finish_reason": completion.finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": self._usage(last)}
