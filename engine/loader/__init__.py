"""Model loading: built-in names, GGUF files and Hugging Face folders -> ``LoadedModel``.

GGUF files are dequantized to float32, renamed to Hugging Face Llama names, unpermuted
to the rotate-half RoPE layout, and cached on disk as Hugging Face folders.
"""

from engine.loader.errors import ModelLoadError
from engine.loader.errors import FALLBACK_CHAT_TEMPLATE
from engine.loader.load import load_model
from engine.loader.loaded_model import LoadedModel
from engine.loader.registry import BUILTIN_MODELS

__all__ = ["BUILTIN_MODELS", "FALLBACK_CHAT_TEMPLATE", "LoadedModel", "ModelLoadError", "load_model"]
