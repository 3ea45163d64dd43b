"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from engine.errors import InvalidRequestError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


def load_engine(model: str, **engine_kwargs) -> LLMEngine:
    """Load ``model`` (a built-in name, a Hugging Face folder or a GGUF file) into an engine.

    Raises:
        engine.loader.ModelLoadError: unknown name or unreadable files.
        ValueError: bad engine options.
    """
    from engine.loader import load_model

    config = EngineConfig(**engine_kwargs)  # validate options before the slow load
    return engine_from_loaded(load_model(model), config)


def engine_from_loaded(loaded, config: EngineConfig | None = None, **engine_kwargs) -> LLMEngine:
    """An engine over an already loaded ``engine.loader.LoadedModel``."""
    config = config or EngineConfig(**engine_kwargs)
    return LLMEngine(
        loaded.config,
        loaded.state_dict,
        loaded.tokenizer,
        config,
        model_name=loaded.name,
        chat_template=loaded.chat_template,
    )


def encode_chat(engine: LLMEngine, messages: list[dict]) -> list[int]:
    """Apply the model's chat template (with the generation prompt) and tokenize.

    Raises:
        InvalidRequestError: an empty list, or a message without a string role/content.
    """
    if not messages:
        raise InvalidRequestError("messages must not be empty", code="empty_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"message {i} needs a string 'role' and 'content'", code="invalid_message")
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        messages, chat_template=engine.chat_template, add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


class LLM:
    """Offline batched generation, as users of vLLM know it.

    Args:
        model: built-in name (``smollm2-135m-instruct``, ``stories260k``), a
            Hugging Face folder, or a ``.gguf`` file.
        **engine_kwargs: ``EngineConfig`` fields (``block_size``,
            ``num_gpu_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``, ``dtype``, ``device``, ...).

    Raises:
        engine.loader.ModelLoadError: the model cannot be found or read.
    """

    def __init__(self, model: str, **engine_kwargs) -> None:
        self.engine = load_engine(model, **engine_kwargs)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        self = cls.__new__(cls)
        self.engine = engine
        self._ids = itertools.count()
        return self

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        tenant_id: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in input order.

        Raises:
            InvalidRequestError: any bad prompt or parameter, before anything runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt", code="invalid_parameter")
        encoded = [self._encode(p) for p in prompts]
        for ids, p in zip(encoded, params):  # refuse bad input before anything is scheduled
            self.engine.validate(ids, p)
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(encoded, params, texts, use_tqdm, tenant_id)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
        tenant_id: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise InvalidRequestError("messages must not be empty", code="empty_messages")
        encoded = [encode_chat(self.engine, c) for c in conversations]
        return self.generate(encoded, sampling_params, use_tqdm=use_tqdm, tenant_id=tenant_id)

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any (they also exit with this process)."""
        self.engine.shutdown()

    def stats(self) -> dict:
        return self.engine.stats()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", code="empty_prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; pass token ids", code="invalid_prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, encoded, params, texts, use_tqdm, tenant_id) -> list[RequestOutput]:
        ids = [f"offline-{next(self._ids)}" for _ in encoded]
        for rid, prompt_ids, p in zip(ids, encoded, params):
            self.engine.add_request(rid, prompt_ids, p, tenant_id=tenant_id)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        results = []
        for rid, text in zip(ids, texts):
            out = final[rid]
            out.prompt = text
            results.append(out)
        return results
