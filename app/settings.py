"""Settings of the chatgate process; the only module that reads the environment.

Every field can be set by an environment variable ``CHATGATE_<FIELD>`` (case
insensitive), e.g. ``CHATGATE_PORT=9000``, ``CHATGATE_DATABASE_URL=postgresql+asyncpg://...``,
``CHATGATE_ALLOWED_ORIGINS=https://a.example,https://b.example`` (comma-separated
or a JSON list). Values are validated once, at construction; the object is frozen.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class Settings(BaseSettings):
    """Validated configuration. Units are in the field names (``_s`` seconds, ``_bytes``)."""

    model_config = SettingsConfigDict(env_prefix="CHATGATE_", case_sensitive=False, frozen=True, extra="forbid")

    # ---- server ----
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    # Debugging aid: log prompts and answers (never keys). Off in production.
    log_prompts: bool = False
    # Origins allowed to open the WebSocket / call the API from a browser; default:
    # this server itself on localhost and 127.0.0.1.
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # ---- storage ----
    data_dir: Path = Path("data")
    # Default: a SQLite file ``<data_dir>/chatgate.db`` (absolute path).
    database_url: str = ""

    # ---- model and engine ----
    model: str = "smollm2-135m-instruct"
    block_size: int = Field(16, ge=1, le=1024)  # tokens per KV block
    num_gpu_blocks: int | None = Field(None, ge=1)  # None: size the pool from free memory
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)  # token budget of one scheduler step
    max_model_len: int | None = Field(None, ge=1)  # None: the model's own limit
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    tensor_parallel_size: int = Field(1, ge=1)  # ranks the model is split across (engine.executor)
    tensor_parallel_timeout_s: float = Field(300.0, gt=0)  # a rank waiting longer in a collective fails the engine

    # ---- gateway ----
    auth_timeout_s: float = Field(5.0, gt=0)  # time a socket has to authenticate
    ws_max_message_bytes: int = Field(65536, ge=1024)
    ws_send_queue_size: int = Field(256, ge=1)  # events buffered per socket for slow readers
    admin_token: SecretStr | None = None  # enables the admin API (issue 6)

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("host must not be empty")
        return value.strip()

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [o.strip() for o in text.split(",") if o.strip()]
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _check_origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not re.match(r"^https?://[^/\s]+$", origin):
                raise ValueError(f"origin {origin!r} must look like scheme://host[:port] (no path) or be '*'")
        return [o.rstrip("/") for o in value]

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if value and not re.match(r"^(sqlite|postgres(ql)?)(\+\w+)?://", value):
            raise ValueError("database_url must be a sqlite+aiosqlite:// or postgresql+asyncpg:// URL")
        return value

    @model_validator(mode="after")
    def _derive_defaults(self) -> Settings:
        # Frozen model: fill derived defaults through object.__setattr__, once.
        if not self.database_url:
            path = (self.data_dir / "chatgate.db").expanduser().resolve()
            object.__setattr__(self, "database_url", f"sqlite+aiosqlite:///{path}")
        if not self.allowed_origins:
            origins = [f"http://localhost:{self.port}", f"http://127.0.0.1:{self.port}"]
            object.__setattr__(self, "allowed_origins", origins)
        return self

    def engine_options(self) -> dict[str, object]:
        """The engine's knobs as plain keyword arguments (the engine never sees Settings)."""
        return {
            "model": self.model,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "device": self.device,
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel_timeout_s": self.tensor_parallel_timeout_s,
        }


def get_settings(**overrides: object) -> Settings:
    """Settings from the environment, with ``overrides`` (field names) taking precedence.

    Raises:
        pydantic.ValidationError: a value is out of range or malformed; the message
            names the field and its environment variable's value.
    """
    return Settings(**overrides)
