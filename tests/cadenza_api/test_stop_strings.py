"""Stop strings as vLLM applies them: the earliest match in the text wins whatever the list's
order, and none ends a request before min_tokens tokens exist."""

from __future__ import annotations

import pytest

from cadenza import SamplingParams
from cadenza.actors.output_processor import SequenceState
from cadenza.messages import EngineOutput
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model
from cadenza.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(*read_model(DEFAULT_MODEL))


def _run(tokenizer: Tokenizer, text: str, params: SamplingParams, one_delta: bool) -> SequenceState:
    prompt = tokenizer.encode("Say:")
    seq = SequenceState(0, tokenizer, prompt, params)
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = [ids] if one_delta else [[i] for i in ids]
    for chunk in chunks:
        if seq.process(EngineOutput(request_id="r", new_token_ids=chunk)):
            break
    return seq


@pytest.mark.parametrize("one_delta", [True, False], ids=["one_delta", "token_by_token"])
def test_the_earliest_stop_string_wins_whatever_the_list_order(tokenizer: Tokenizer, one_delta: bool) -> None:
    seq = _run(tokenizer, "hello world and more", SamplingParams(stop=["world", "hello"]), one_delta)
    assert seq.finish_reason == "stop" and seq.stop_reason == "hello" and seq.text == ""
    keep = SamplingParams(stop=["world", "hello"], include_stop_str_in_output=True)
    seq = _run(tokenizer, "say hello world", keep, one_delta)
    assert seq.stop_reason == "hello" and seq.text == "say hello"


def test_a_stop_string_does_not_end_a_request_before_min_tokens(tokenizer: Tokenizer) -> None:
    text = "stop here, then go on and stop again later"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    early = _run(tokenizer, text, SamplingParams(stop=["stop"], min_tokens=0), one_delta=False)
    assert early.text == "" and early.stop_reason == "stop"
    late = _run(tokenizer, text, SamplingParams(stop=["stop"], min_tokens=4, max_tokens=n), one_delta=False)
    assert late.finish_reason == "stop" and late.text == "stop here, then go on and "
    assert len(late.token_ids) >= 4
