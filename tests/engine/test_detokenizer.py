"""Streaming text: deltas concatenate to the final text, never a broken UTF-8 character, stop strings never leak."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.llm import LLM, engine_from_loaded

TEXTS = [
    "Hello, world! 😀 Emoji 👩‍👩‍👧 and CJK 日本語のテキスト, 中文字符。",
    "  leading spaces\nnew lines\t tabs and ✓ marks — dashes “quotes”",
    "Ünïcödé àccents, Ελληνικά, русский, עברית, 🇫🇷🚀",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for i, t in enumerate(ids):
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return deltas


@pytest.mark.parametrize("model_fixture", ["stories_model", "smollm2_model"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode_and_is_valid_utf8(request, model_fixture, text):
    tok = request.getfixturevalue(model_fixture).tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say:", add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok, prompt), ids)
    # The continuation's text as it reads after the prompt (a SentencePiece word
    # token keeps its leading space there).
    whole = tok.decode(prompt + ids, skip_special_tokens=True)
    assert "".join(deltas) == whole[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert all("\ufffd" not in d for d in deltas)
    for d in deltas:  # each delta is well-formed text on its own
        d.encode("utf-8")


def test_byte_fallback_tokens_are_held_until_the_character_completes(stories_model):
    tok = stories_model.tokenizer
    ids = tok.encode("😀", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert any(p.startswith("<0x") for p in pieces), pieces  # really byte fallback
    deltas = _stream(IncrementalDetokenizer(tok, [1]), ids)
    assert [d for d in deltas if d] == [tok.decode(ids)]
    assert "😀" in deltas[-1]


@pytest.mark.parametrize("stop", ["named Lily", "ily.", " girl", "e"])
def test_stop_string_spanning_tokens_is_never_emitted(stories_model, stop):
    llm = LLM.from_engine(engine_from_loaded(stories_model, num_gpu_blocks=64))
    free = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60))[0].outputs[0].text
    assert stop in free
    engine = llm.engine
    engine.add_request("s", engine.tokenizer.encode("Once upon a time"), SamplingParams(temperature=0, max_tokens=60, stop=[stop]))
    streamed, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.outputs[0].delta_text)
            final = out.outputs[0]
            joined = "".join(streamed)
            assert stop not in joined
            # Everything emitted so far is a prefix of the free text, cut before the stop.
            assert free.startswith(joined)
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(streamed) == final.text == free[: free.index(stop)]


def test_streamed_deltas_concatenate_to_the_final_text_on_sampled_chat(smollm2_model):
    llm = LLM.from_engine(engine_from_loaded(smollm2_model, num_gpu_blocks=256))
    engine = llm.engine
    from engine.llm import encode_chat

    ids = encode_chat(engine, [{"role": "user", "content": "Write one sentence with an emoji and a Chinese word."}])
    engine.add_request("c", ids, SamplingParams(temperature=0.8, seed=5, max_tokens=60))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out.outputs[0]
    assert "".join(deltas) == final.text
    assert all("\ufffd" not in d for d in deltas)
    assert final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)
