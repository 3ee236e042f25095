"""Prompts as the engine clients take them: a TokensPrompt passes its ids through untouched,
the dict prompts docs/python-api.md shows still work, and every EngineClient takes what the Protocol names."""

from __future__ import annotations

import inspect

import pytest

from cadenza.actors.prompts import tokenize
from cadenza.actors.stream_client import StreamingClient
from cadenza.engine_client import EngineClient, TokensPrompt


def test_a_tokens_prompt_needs_no_tokenizer_and_has_no_text() -> None:
    assert tokenize(None, TokensPrompt([5, 6, 7])) == (None, [5, 6, 7])


def test_dict_prompts_stay_as_the_readme_shows() -> None:
    assert tokenize(None, {"prompt_token_ids": [1, 2]}) == (None, [1, 2])
    assert tokenize(None, {"prompt": "hi", "prompt_token_ids": [1, 2]}) == ("hi", [1, 2])


@pytest.mark.parametrize("prompt", [TokensPrompt([]), {"prompt_token_ids": []}])
def test_an_empty_prompt_is_refused(prompt: TokensPrompt | dict) -> None:
    with pytest.raises(ValueError, match="empty"):
        tokenize(None, prompt)


@pytest.mark.parametrize("prompt", [42, {"text": "hi"}])
def test_an_unknown_shape_names_the_ones_there_are(prompt: object) -> None:
    with pytest.raises(ValueError, match="TokensPrompt"):
        tokenize(None, prompt)  # type: ignore[arg-type]


def test_text_without_a_tokenizer_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="TokensPrompt"):
        tokenize(None, "hello")


def test_streaming_client_takes_every_argument_the_protocol_names() -> None:
    """The gateway calls EngineClient.generate with these keywords (session_id included):
    the implementation must accept each, with the same default."""
    wanted = inspect.signature(EngineClient.generate).parameters
    given = inspect.signature(StreamingClient.generate).parameters
    for name, param in wanted.items():
        assert name in given, name
        assert given[name].default == param.default, name
