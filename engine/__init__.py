"""chatgate's inference engine: paged KV cache, continuous batching, our own Llama model.

Offline use::

    from engine import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.7, max_tokens=50))
    print(outs[0].outputs[0].text)
"""

from engine.errors import EngineDeadError, InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequestError",
           "EngineDeadError"]


def __getattr__(name: str):
    # Lazy, so `import engine` stays cheap for code that only needs the data types.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
