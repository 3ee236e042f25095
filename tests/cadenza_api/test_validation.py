"""cadenza.request_limits, the one request-validation module: context length, the default
max_tokens of the engine and of the gateway, the model name and the API key a client presents.
Pure functions: no model, no engine."""

from __future__ import annotations

import pickle

import pytest

from cadenza.request_limits import (
    KEY_SUBPROTOCOL,
    ContextLengthError,
    RequestLimits,
    UnknownModelError,
    check_context,
    check_model,
    check_request,
    context_room,
    key_subprotocol,
    max_tokens_or_default,
    max_tokens_to_fill,
    offered_subprotocols,
    presented_key,
    presented_keys,
)
from cadenza.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=160, max_model_len=128)


def test_room_is_what_the_prompt_leaves_of_the_context() -> None:
    assert context_room(100, 128) == 28
    assert context_room(127, 128) == 1
    with pytest.raises(ContextLengthError, match="max_model_len=128") as caught:
        context_room(128, 128)
    assert caught.value.field == "prompt"


def test_max_tokens_must_fit_after_the_prompt() -> None:
    assert check_context(100, 28, 128) == 28
    assert check_context(100, None, 128) == 28  # not asked: only the prompt is checked
    with pytest.raises(ContextLengthError, match=r"prompt \(100 tokens\) plus max_tokens \(29\)") as caught:
        check_context(100, 29, 128)
    assert caught.value.field == "max_tokens"
    assert isinstance(caught.value, ValueError)  # the engine's error shape


def test_messages_use_the_callers_terms() -> None:
    terms = ("input", "max_output_tokens")
    with pytest.raises(ContextLengthError, match="the input"):
        check_context(200, None, 128, terms)
    with pytest.raises(ContextLengthError, match=r"max_output_tokens \(50\)"):
        check_context(100, 50, 128, terms)


def test_the_gateway_default_is_its_budget_capped_by_the_room_left() -> None:
    assert max_tokens_or_default(10, None, 128, default=16) == 16
    assert max_tokens_or_default(120, None, 128, default=16) == 8
    assert max_tokens_or_default(10, 100, 128, default=16) == 100  # asked: as asked
    with pytest.raises(ContextLengthError):
        max_tokens_or_default(10, 119, 128, default=16)


def test_the_engine_default_fills_both_the_context_and_the_kv_pool() -> None:
    assert max_tokens_to_fill(10, 128, kv_tokens=1024) == 118  # the context is smaller
    assert max_tokens_to_fill(10, 128, kv_tokens=32) == 22  # the pool is smaller
    with pytest.raises(ValueError, match="no room to generate in the KV pool"):
        max_tokens_to_fill(32, 128, kv_tokens=32)
    with pytest.raises(ContextLengthError, match="no room"):
        max_tokens_to_fill(128, 128, kv_tokens=1024)


def test_check_request_includes_the_context() -> None:
    check_request(SamplingParams(max_tokens=26), [1, 2], LIMITS)
    with pytest.raises(ContextLengthError, match="max_model_len=128"):
        check_request(SamplingParams(max_tokens=127), [1, 2], LIMITS)
    with pytest.raises(ValueError, match="empty"):
        check_request(SamplingParams(max_tokens=1), [], LIMITS)


def test_the_context_error_survives_pickling() -> None:  # Ray ships exceptions pickled
    error = pickle.loads(pickle.dumps(ContextLengthError("too long", "max_tokens")))
    assert str(error) == "too long" and error.field == "max_tokens"


def test_a_request_names_the_served_model_or_none() -> None:
    check_model(None, "smol")
    check_model("smol", "smol")
    with pytest.raises(UnknownModelError, match="'gpt-9' does not exist here; this server serves 'smol'"):
        check_model("gpt-9", "smol")


def test_the_bearer_key_comes_first() -> None:
    headers = {"authorization": "Bearer  k1 ", "sec-websocket-protocol": f"x, {KEY_SUBPROTOCOL}k2"}
    assert presented_key(headers) == "k1"
    assert presented_keys(headers) == ["k1", "k2"]
    assert presented_keys(headers, subprotocols=False) == ["k1"]  # plain HTTP: the header only


def test_a_browser_offers_its_key_as_a_subprotocol() -> None:
    headers = {"sec-websocket-protocol": f"chat, {KEY_SUBPROTOCOL}k2, {KEY_SUBPROTOCOL}k3"}
    assert offered_subprotocols(headers) == ["chat", f"{KEY_SUBPROTOCOL}k2", f"{KEY_SUBPROTOCOL}k3"]
    assert key_subprotocol(offered_subprotocols(headers)) == f"{KEY_SUBPROTOCOL}k2"  # echoed on accept
    assert presented_key(headers) == "k2"
    assert presented_keys(headers) == ["k2", "k3"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Basic abc"}, {"authorization": "k1"}, {"sec-websocket-protocol": "chat, , json"}],
)
def test_no_key(headers: dict[str, str]) -> None:
    assert presented_key(headers) is None and presented_keys(headers) == []
    assert key_subprotocol(offered_subprotocols(headers)) is None


def test_a_blank_bearer_is_presented_as_empty() -> None:  # checked as a key: a wrong one
    assert presented_keys({"authorization": "Bearer "}) == [""]
