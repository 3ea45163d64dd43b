"""Model definitions of our own (Llama family)."""
