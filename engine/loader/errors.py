"""The one error type the loader raises."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded: unknown name, missing or unreadable file, corrupt
    data, or an architecture the engine does not serve. The message names the problem
    and the path or name involved."""
