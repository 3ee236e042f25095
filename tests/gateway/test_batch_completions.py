"""/v1/completions takes every prompt form the OpenAI API allows: a string, token ids, and the
two batch forms (texts, token-id lists) that evaluation harnesses send; prompt i's choices are
numbered i * n + j, usage is summed, whole or streamed, and the batch size is bounded."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    settings = GatewaySettings(port=free_port(), max_prompts_per_request=4)
    with serve_in_thread(build_app(PacedEngine(0.0), DEFAULT_MODEL, settings), settings.port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{settings.port}/v1", api_key="none")


@pytest.mark.parametrize("prompt", [["one", "two words"], [[5, 6, 7], [8, 9]]])
def test_a_batch_answers_each_prompts_choices_in_order(client: openai.OpenAI, prompt: list) -> None:
    reply = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=3)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.text == "aaa" and c.finish_reason == "length" for c in reply.choices)
    single = [client.completions.create(model=DEFAULT_MODEL, prompt=p, max_tokens=3).usage for p in prompt]
    assert reply.usage.prompt_tokens == sum(u.prompt_tokens for u in single)
    assert reply.usage.completion_tokens == 2 * 3


def test_a_streamed_batch_renumbers_its_chunks_and_sums_its_usage(client: openai.OpenAI) -> None:
    usage = {"include_usage": True}
    stream = client.completions.create(
        model=DEFAULT_MODEL, prompt=["x", "y", "z"], max_tokens=2, stream=True, stream_options=usage
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "aa", 1: "aa", 2: "aa"}
    assert len({c.id for c in chunks}) == 1  # one response
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_too_many_prompts_or_a_mix_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="5 prompts in one request; at most 4"):
        client.completions.create(model=DEFAULT_MODEL, prompt=["a"] * 5, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="not a mix"):
        client.completions.create(model=DEFAULT_MODEL, prompt=["a", [5, 6]], max_tokens=1)


def test_with_n_choices_prompt_i_numbers_its_choices_i_times_n_plus_j() -> None:
    from cadenza.gateway.batch_run import BatchRun

    batch = BatchRun([], n=3)
    assert [c["index"] for c in batch.renumber(2, [{"index": 0}, {"index": 2}])] == [6, 8]
