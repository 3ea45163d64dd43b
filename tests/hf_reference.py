"""Reference generations from Hugging Face transformers, for parity tests."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel


@lru_cache(maxsize=4)
def hf_model(hf_dir: str | Path) -> PreTrainedModel:
    """``AutoModelForCausalLM`` from ``hf_dir`` in float32 on the CPU, eval mode (cached)."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    # NOTE: generate() fills unset options from the model's generation config, so its
    # EOS ids would stop generation; this model object is ours alone, so drop them.
    model.generation_config = GenerationConfig()
    return model.eval()


def hf_greedy(hf_dir: str | Path, prompt_ids_list: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers, one prompt at a time (no padding).

    Pure argmax for exactly ``max_new_tokens`` tokens: EOS neither stops generation
    nor is masked (vLLM's ``ignore_eos`` semantics), so an engine run with
    ``ignore_eos=True, temperature=0`` must produce the same ids.

    Args:
        hf_dir: a Hugging Face folder, e.g. ``LoadedModel.hf_dir``.
        prompt_ids_list: prompts as token ids (include BOS yourself if the model wants it).
        max_new_tokens: tokens to generate per prompt.
    Returns:
        the generated ids per prompt (prompt excluded), each of length ``max_new_tokens``.
    """
    model = hf_model(hf_dir)
    # NOTE: an explicit config, so the folder's generation_config (eos ids) is not merged in.
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=None,
        bos_token_id=None, num_beams=1,
    )
    out: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompt_ids_list:
            ids = torch.tensor([prompt], dtype=torch.long)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            new = seq[0, len(prompt):].tolist()
            assert len(new) == max_new_tokens, f"generation stopped early: {len(new)} < {max_new_tokens}"
            out.append(new)
    return out
