"""``/v1/completions`` (legacy text completion) through the ``openai`` package."""

from __future__ import annotations

import pytest

from tests.openai.conftest import STORIES_MAX_MODEL_LEN, make_client

pytest.importorskip("openai")

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def offline_llm(stories_path):
    from engine import LLM

    return LLM("stories260k", max_model_len=STORIES_MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def offline_text(offline_llm) -> str:
    from engine import SamplingParams

    return offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text


def test_text_completion_greedy_equals_the_offline_engine(openai_gateway, model_name, offline_text):
    r = make_client(openai_gateway, openai_gateway.keys["alpha"]).completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=24
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == offline_text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0


def test_streamed_text_completion_joins_to_the_same_text(openai_gateway, model_name, offline_text):
    stream = make_client(openai_gateway, openai_gateway.keys["alpha"]).completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline_text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_token_id_prompt_is_accepted(openai_gateway, model_name, offline_llm):
    client = make_client(openai_gateway, openai_gateway.keys["alpha"])
    by_text = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8)
    ids = offline_llm.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=model_name, prompt=list(ids), temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
