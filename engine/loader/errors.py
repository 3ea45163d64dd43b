"""The one error type the loader raises."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded: unknown name, missing or unreadable file, corrupt
    data, or an architecture the engine does not serve. The message names the problem
    and the path or name involved."""


# The chat template of models that ship none: the messages' contents, concatenated.
FALLBACK_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
