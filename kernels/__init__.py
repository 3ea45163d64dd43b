"""Attention and KV-cache kernels: Triton implementations and plain-PyTorch references.

KV cache layout used everywhere (per layer, one tensor for K and one for V):
``(num_blocks, block_size, num_kv_heads, head_dim)``. A token's *slot* is
``block_id * block_size + offset``.
"""

# Triton kernels load lazily, so that importing the references (the CPU backend)
# never imports Triton; `TRITON_INTERPRET` must be set before the first of these.
_LAZY = {
    "store_kvcache": "kernels.store_kv",
    "paged_decode_attention": "kernels.decode_attention",
    "paged_prefill_attention": "kernels.prefill_attention",
    "copy_blocks": "kernels.copy_blocks",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
