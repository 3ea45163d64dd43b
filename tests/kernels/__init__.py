"""Triton kernels against their plain-PyTorch references."""
