"""Bad input is refused before it is scheduled, with an error naming the problem."""

from __future__ import annotations

import math

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.llm import LLM
from tests.engine.tiny_models import engine_for, make_hf_model


@pytest.fixture(scope="module")
def llm():
    return LLM.from_engine(engine_for(make_hf_model("mha_untied", max_positions=64), num_gpu_blocks=8, block_size=4))


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_impossible_parameters_are_refused(kwargs, names):
    with pytest.raises(InvalidRequestError, match=names):
        SamplingParams(**kwargs)


def test_empty_prompt_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams())


def test_prompt_longer_than_max_model_len_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len") as info:
        llm.generate([[1] * 64], SamplingParams(max_tokens=1))
    assert info.value.code == "prompt_too_long"


def test_request_that_never_fits_the_pool_is_refused_at_once(llm):
    # 8 blocks of 4 tokens = 32 tokens; 20 + 20 needs 10 blocks.
    with pytest.raises(InvalidRequestError, match="KV blocks") as info:
        llm.generate([[1] * 20], SamplingParams(max_tokens=20))
    assert info.value.code == "exceeds_kv_capacity"
    assert not llm.engine.has_unfinished_requests()


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[1, 10_000]], SamplingParams())


def test_one_bad_prompt_refuses_the_batch_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["free_gpu_blocks"] == 8


def test_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    assert llm.stats()["free_gpu_blocks"] == 8


def test_generation_stops_at_max_model_len():
    llm = LLM.from_engine(engine_for(make_hf_model("mha_untied", max_positions=64), num_gpu_blocks=16, block_size=4))
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 4  # 60 + 4 = max_model_len 64
