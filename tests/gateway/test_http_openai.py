"""The OpenAI-compatible HTTP API of `cadenza serve`, through the official `openai` package."""

from __future__ import annotations

import json

import openai
import pytest
from cadenza_testkit.servers import API_KEY

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY)


@pytest.mark.slow
def test_chat_streamed_and_whole_agree_with_the_engine(client, smollm) -> None:
    expected = smollm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens == 24 or whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_completion_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


@pytest.mark.slow
def test_completions_models_logprobs_n_and_stop(client, smollm) -> None:
    prompt = "The three primary colours are"
    expected = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, logprobs=2)
    assert completion.choices[0].text == expected.outputs[0].text
    assert len(completion.choices[0].logprobs.tokens) == 16
    assert all(len(top) <= 2 for top in completion.choices[0].logprobs.top_logprobs)
    assert [m.id for m in client.models.list().data] == [MODEL]

    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in content)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob  # greedy: the best is chosen

    two = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, seed=7, temperature=1.0, max_tokens=12)
    assert sorted(c.index for c in two.choices) == [0, 1]
    stopped = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stop=["Paris"]
    )
    assert "Paris" not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_echo_with_logprobs_returns_the_engines_prompt_logprobs(client, smollm) -> None:
    """How evaluation harnesses score a text: echo, logprobs and max_tokens 0."""
    prompt = "The capital of France is Paris."
    ids = smollm.get_tokenizer().encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    engine = smollm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].prompt_logprobs
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == len(ids)
    for position, (ours, token) in enumerate(zip(choice.logprobs.token_logprobs[1:], ids[1:]), start=1):
        assert ours == pytest.approx(engine[position][token].logprob, abs=1e-4), position
    more = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0)
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert more.choices[0].text == prompt + alone.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == more.choices[0].text
    as_ids = {"return_tokens_as_token_ids": True}
    named = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, logprobs=1, temperature=0, extra_body=as_ids
    )
    assert [t.removeprefix("token_id:").isdigit() for t in named.choices[0].logprobs.tokens] == [True, True]
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def _post(server, path: str, body: bytes, key: str = API_KEY) -> tuple[int, dict]:  # noqa: ANN001
    return server.post(path, body, key)


@pytest.mark.slow
def test_bad_http_input_gets_openai_errors_and_the_server_keeps_serving(server, client) -> None:
    chat = {"model": MODEL, "messages": QUESTION}
    cases = {
        "malformed": (b"{oops", 400),
        "unknown field": (json.dumps({**chat, "temperature_typo": 1}).encode(), 400),
        "mistyped": (json.dumps({**chat, "max_tokens": "lots"}).encode(), 400),
        "over context": (json.dumps({**chat, "messages": [{"role": "user", "content": "hi " * 9000}]}).encode(), 400),
        "max_tokens < 1": (json.dumps({**chat, "max_tokens": 0}).encode(), 400),
        "unknown model": (json.dumps({**chat, "model": "gpt-9"}).encode(), 404),
    }
    for name, (body, status) in cases.items():
        code, error = _post(server, "/v1/chat/completions", body)
        assert code == status, (name, error)
        assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["message"], name
    code, error = _post(server, "/v1/chat/completions", json.dumps(chat).encode(), key="wrong")
    assert code == 401 and error["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.http + "/v1", api_key="wrong").models.list()
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    assert ok.choices[0].message.content
