"""Real models' shapes with random ("dummy") weights, for performance work.

Speed does not depend on weight values, so benchmarks build these instead of
downloading checkpoints. Shapes are copied from the models' Hugging Face
``config.json`` files. Weights are drawn directly on the target device in the
target dtype: no CPU state dict (16 GB for Llama-3-8B) is ever materialised.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.distributed import TensorParallelGroup
from engine.models.llama import LlamaForCausalLM

DUMMY_CONFIGS: dict[str, ModelConfig] = {
    # meta-llama/Meta-Llama-3-8B: 8.03e9 parameters, 16.06 GB in bf16.
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=(128001,),
    ),
    # Qwen/Qwen2.5-0.5B: q/k/v projections with bias, tied embeddings, head_dim 64, GQA 7.
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151643,),
    ),
    # HuggingFaceTB/SmolLM2-135M: head_dim 64, GQA 3, tied embeddings.
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=0, eos_token_ids=(0,),
    ),
}


def dummy_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a dummy model by name.

    Raises:
        ValueError: unknown name.
    """
    try:
        return DUMMY_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown dummy model {name!r}; choose from {sorted(DUMMY_CONFIGS)}") from None


@torch.no_grad()
def build_dummy_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
    tp: TensorParallelGroup | None = None,
) -> LlamaForCausalLM:
    """Build ``LlamaForCausalLM(config, tp)`` with random weights, created on ``device`` in ``dtype``.

    Under tensor parallelism each rank draws its own shard (seed it with the
    rank): no rank ever holds the full model, so an 8B shape needs no host copy.

    Linear weights keep PyTorch's default init (uniform, std ``1/sqrt(3 fan_in)``),
    embeddings are ``N(0, 1)``, biases small and norms 1, so activations stay finite
    in bf16 through any depth (RMSNorm rescales each layer's input).

    Returns:
        the model in eval mode, every parameter and buffer on ``device`` in ``dtype``.
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, tp)
    finally:
        torch.set_default_dtype(previous)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.uniform_(-0.02, 0.02)  # zeros would hide a bias that is never added
    # The rotary tables were computed in fp32 and are rounded to the model's dtype,
    # as they are when a loaded model moves to its dtype.
    return model.to(device=device, dtype=dtype).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters, tied ones counted once (what one decode step must read)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def build_model(
    config: ModelConfig, state_dict: dict[str, torch.Tensor] | None, device: torch.device | str,
    dtype: torch.dtype, seed: int = 0, tp: TensorParallelGroup | None = None,
) -> LlamaForCausalLM:
    """One rank's model: loaded from full-size HF-named ``state_dict`` (its slices taken), or,
    when ``state_dict`` is None, dummy weights drawn with ``seed`` (``build_dummy_model``).

    Returns:
        the model in eval mode on ``device`` in ``dtype``.

    Raises:
        ValueError: weights that do not fit the model, or a group size that does not divide it.
    """
    if state_dict is None:
        return build_dummy_model(config, device, dtype, seed, tp=tp)
    model = LlamaForCausalLM(config, tp)
    model.load_hf_state_dict(state_dict)
    return model.to(device=device, dtype=dtype).eval()
