"""Errors the engine raises to its callers."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; refused before it is scheduled.

    ``code`` is a short machine-readable reason (e.g. ``"prompt_too_long"``) that a
    gateway can forward; the message names the problem for a person.
    """

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests (its thread stopped, or a
    tensor-parallel worker died); requests in flight end with this error."""
