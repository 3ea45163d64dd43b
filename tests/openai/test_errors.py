"""Refusals in OpenAI's shape, raised as the exceptions the ``openai`` package expects."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.openai.conftest import make_client

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Tom had a red ball"}]


def _post(server, body: dict, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _assert_error_shape(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code
    return error


def test_bad_key_is_an_authentication_error(openai_gateway, model_name):
    client = make_client(openai_gateway, "cg_nothere0_" + "x" * 43)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_missing_key_is_401_in_openai_shape(openai_gateway, model_name):
    _assert_error_shape(_post(openai_gateway, {"model": model_name, "messages": MESSAGES}, None), 401,
                        "invalid_api_key")  # fmt: skip


def test_out_of_range_parameter_is_a_bad_request_naming_the_parameter(openai_gateway, model_name):
    client = make_client(openai_gateway, openai_gateway.keys["alpha"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=5)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[])
    assert info.value.body["param"] == "messages"


def test_malformed_json_and_missing_fields_are_400(openai_gateway, model_name):
    key = openai_gateway.keys["alpha"]
    r = httpx.post(f"{openai_gateway.base}/v1/chat/completions", content=b"{nope",
                   headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})  # fmt: skip
    _assert_error_shape(r, 400, "invalid_json")
    error = _assert_error_shape(_post(openai_gateway, {"model": model_name}, key), 400, "missing_required_parameter")
    assert error["param"] == "messages"


def test_unknown_model_is_not_found(openai_gateway):
    client = make_client(openai_gateway, openai_gateway.keys["alpha"])
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert info.value.code == "model_not_found"


def test_prompt_that_fills_the_context_is_context_length_exceeded(openai_gateway, model_name):
    client = make_client(openai_gateway, openai_gateway.keys["alpha"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "cat " * 400}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="cat " * 400)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_forbidden_priority_is_a_permission_error(openai_gateway, model_name):
    client = make_client(openai_gateway, openai_gateway.keys["rpm"])  # allowed: standard, batch
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2,
                                       extra_body={"priority": "interactive"})  # fmt: skip
    assert info.value.code == "priority_not_allowed"


def test_rate_quota_is_a_retryable_rate_limit_error_with_retry_after(openai_gateway, model_name):
    client = make_client(openai_gateway, openai_gateway.keys["rpm"])  # 1 request a minute
    deadline = time.monotonic() + 5
    refused = None
    while refused is None and time.monotonic() < deadline:
        try:
            client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
        except openai.RateLimitError as exc:
            refused = exc
    assert refused is not None, "the second request of the minute was not refused"
    assert refused.status_code == 429 and refused.code == "rate_limit_exceeded"
    headers = refused.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "1" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers.get("x-should-retry") != "false"


def test_used_up_budget_is_insufficient_quota_and_says_not_to_retry(openai_gateway, model_name):
    client = make_client(openai_gateway, openai_gateway.keys["broke"])  # 10 tokens a day
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=50)
    assert info.value.code == "insufficient_quota" and info.value.type == "insufficient_quota"
    assert info.value.response.headers["x-should-retry"] == "false"
    # The client with retries on gives up at once: the server said retrying does not help.
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError):
        make_client(openai_gateway, openai_gateway.keys["broke"]).with_options(max_retries=3).chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=50
        )
    assert time.monotonic() - started < 1.0
