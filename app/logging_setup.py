"""Structured logs: one JSON object per line (or ``key=value`` on a terminal), with the chat's request id.

Every record carries ``ts``, ``level``, ``logger``, ``msg`` and, inside a chat, the
``request_id`` of that chat (set by :func:`bind_request_id`, held in a context
variable, so each chat's task logs its own id). Extra fields given as
``log.info("...", extra={"fields": {...}})`` are merged into the object.

Secrets: API keys are never passed to a logger; as a second line of defence the
formatter masks anything shaped like a chatgate key (``cg_`` + prefix + secret)
down to its visible prefix. Prompts and answers are logged only when the
``log_prompts`` setting asks for it (a debugging aid; never in production).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from typing import Any, TextIO

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("chatgate_request_id", default=None)

# tenancy.keys issues "cg_<prefix>_<secret>"; keep "cg_<prefix>" (it is shown in listings anyway).
_KEY_RE = re.compile(r"\b(cg_[A-Za-z0-9]{4,16})_[A-Za-z0-9_\-]{16,}")
_BEARER_RE = re.compile(r"(?i)(bearer\s+)(\S+)")
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "fields"}


def bind_request_id(request_id: str | None) -> None:
    """Tag every later log record of the current task (and the tasks it starts) with ``request_id``."""
    request_id_var.set(request_id)


def redact(text: str) -> str:
    """Mask API keys and bearer tokens in ``text`` (keeps a key's visible prefix)."""
    text = _KEY_RE.sub(r"\1_…", text)
    return _BEARER_RE.sub(r"\1…", text)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": redact(record.getMessage()),
    }
    request_id = request_id_var.get()
    if request_id is not None:
        out["request_id"] = request_id
    extra = getattr(record, "fields", None)
    if isinstance(extra, dict):
        out.update(extra)
    if record.exc_info:
        out["exc"] = redact(logging.Formatter().formatException(record.exc_info))
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line (for log shippers: Loki, Elasticsearch, CloudWatch)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), ensure_ascii=False, default=str)


class KeyValueFormatter(logging.Formatter):
    """``ts level logger msg key=value ...`` for a person at a terminal; still greppable."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        head = f"{fields.pop('ts')} {fields.pop('level').upper():<7} {fields.pop('logger')}: {fields.pop('msg')}"
        exc = fields.pop("exc", None)
        tail = " ".join(f"{k}={_kv(v)}" for k, v in fields.items())
        return head + (f" {tail}" if tail else "") + (f"\n{exc}" if exc else "")


def _kv(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(text) if (not text or any(c in text for c in ' ="')) else text


def configure_logging(level: str = "info", *, json_lines: bool | None = None, stream: TextIO | None = None) -> None:
    """Route the root logger (and uvicorn's) through one structured handler.

    Args:
        level: a ``Settings.log_level`` value (``trace`` means ``debug``).
        json_lines: JSON per line; ``None`` picks JSON unless ``stream`` is a terminal.
        stream: where to write; default ``sys.stderr``.
    """
    stream = stream or sys.stderr
    if json_lines is None:
        json_lines = not (hasattr(stream, "isatty") and stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel("DEBUG" if level == "trace" else level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True


def uvicorn_log_config() -> dict[str, Any]:
    """A ``log_config`` for ``uvicorn.run`` that leaves its loggers to :func:`configure_logging`."""
    return {"version": 1, "disable_existing_loggers": False}
