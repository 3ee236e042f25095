"""Request fields real clients send: vLLM's streamed usage and sampling extras, OpenAI's
logit_bias, and OpenAI fields accepted without effect (named back in a header)."""

from __future__ import annotations

import json
import typing
import urllib.error
import urllib.request

import openai
import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza import LLM, SamplingParams
from cadenza.gateway.app import build_app
from cadenza.gateway.openai_schema import IGNORED, ChatCompletionRequest, CompletionRequest
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def paced() -> str:
    port = free_port()
    app = build_app(PacedEngine(pace=0.001), DEFAULT_MODEL, GatewaySettings(port=port))
    with serve_in_thread(app, port):
        yield f"http://127.0.0.1:{port}"


def _post(url: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_continuous_usage_stats_puts_the_running_usage_in_every_chunk(paced: str) -> None:
    client = openai.OpenAI(base_url=paced + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=HI, max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert len(chunks) == 5
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_openai_fields_without_effect_are_accepted_and_named_back(paced: str) -> None:
    body = {"model": DEFAULT_MODEL, "messages": HI, "max_tokens": 2, "store": False, "metadata": {"k": "v"}}
    body |= {"parallel_tool_calls": True, "service_tier": "auto", "user": "u1", "reasoning_effort": "low"}
    body |= {"web_search_options": {}}
    status, headers, _ = _post(paced + "/v1/chat/completions", body)
    assert status == 200
    named = headers["x-cadenza-ignored-fields"].split(",")
    assert named == ["store", "metadata", "reasoning_effort", "web_search_options"]
    status, headers, _ = _post(
        paced + "/v1/chat/completions", {"model": DEFAULT_MODEL, "messages": HI, "max_tokens": 1}
    )
    assert status == 200 and "x-cadenza-ignored-fields" not in headers
    assert set(IGNORED) <= set(ChatCompletionRequest.__struct_fields__) & set(CompletionRequest.__struct_fields__)


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
# One plausible value for every field of the openai package's request types.
CHAT_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.1, "function_call": "auto",
    "functions": [WEATHER["function"]], "logit_bias": {"5": 1}, "logprobs": True, "max_completion_tokens": 2,
    "max_tokens": 2, "messages": HI, "metadata": {"k": "v"}, "modalities": ["text"], "model": DEFAULT_MODEL,
    "moderation": {"model": "omni-moderation-latest"}, "n": 1, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.1, "prompt_cache_key": "k",
    "prompt_cache_options": {}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 1, "service_tier": "auto",
    "stop": ["zz"], "store": False, "stream_options": {"include_usage": True}, "temperature": 0.5,
    "tool_choice": "auto", "tools": [WEATHER], "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low",
    "web_search_options": {},
}  # fmt: skip
COMPLETION_VALUES = {
    "best_of": 1, "echo": True, "frequency_penalty": 0.1, "logit_bias": {"5": 1}, "logprobs": 1, "max_tokens": 2,
    "model": DEFAULT_MODEL, "n": 1, "presence_penalty": 0.1, "prompt": "hi", "seed": 1, "stop": "zz",
    "stream_options": {"include_usage": True}, "suffix": "!", "temperature": 0.5, "top_p": 0.9, "user": "u",
}  # fmt: skip


RESPONSES_VALUES = {
    "access_programs": [], "background": False, "background_options": {}, "context_management": [],
    "conversation": "conv_1", "image": None, "include": ["message.output_text.logprobs"], "input": "hi",
    "instructions": "Be brief.", "max_output_tokens": 2, "max_tool_calls": 1, "metadata": {"k": "v"},
    "model": DEFAULT_MODEL, "moderation": None, "parallel_tool_calls": True, "previous_response_id": None,
    "prompt": {"id": "pmpt_1"}, "prompt_cache_key": "k", "prompt_cache_options": {}, "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low"}, "safety_identifier": "s", "service_tier": "auto", "store": True,
    "stream_options": {"include_obfuscation": False}, "temperature": 0.5, "text": {"format": {"type": "json_object"}},
    "tool_choice": "auto", "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
    "top_logprobs": 2, "top_p": 0.9, "truncation": "disabled", "user": "u",
}  # fmt: skip
BASES = {
    "/v1/chat/completions": {"model": DEFAULT_MODEL, "messages": HI, "max_tokens": 2},
    "/v1/completions": {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": DEFAULT_MODEL, "input": "hi", "max_output_tokens": 2},
}


@pytest.mark.parametrize(
    "path,params,values",
    [
        ("/v1/chat/completions", openai.types.chat.completion_create_params.CompletionCreateParamsBase, CHAT_VALUES),
        ("/v1/completions", openai.types.completion_create_params.CompletionCreateParamsBase, COMPLETION_VALUES),
        ("/v1/responses", openai.types.responses.response_create_params.ResponseCreateParamsBase, RESPONSES_VALUES),
    ],
)
def test_every_openai_request_field_is_accepted(paced: str, path: str, params: type, values: dict) -> None:
    fields = set(typing.get_type_hints(params))
    assert fields <= set(values), f"fields the openai package added: {sorted(fields - set(values))}"
    for field in sorted(fields):
        status, _, body = _post(paced + path, {**BASES[path], field: values[field]})
        assert status == 200, (field, body)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("logit_bias", {"abc": 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {"5": 101}, "logit_bias values must be in"),
        ("logit_bias", {"999999": 1}, "logit_bias token ids must be in"),
        ("logit_bias", {str(t): 1 for t in range(301)}, "at most 300 logit_bias entries (max_logit_bias)"),
        ("allowed_token_ids", list(range(16385)), "(max_allowed_token_ids)"),
        ("bad_words", [f"w{i}" for i in range(129)], "at most 128 bad_words (max_bad_words)"),
        ("bad_words", [" word" * 40], "at most 32 tokens (max_bad_word_tokens)"),
        ("no_such_field", 1, "no_such_field"),
    ],
)
def test_bad_values_are_a_400_naming_the_problem(paced: str, field: str, value: object, message: str) -> None:
    status, _, body = _post(paced + "/v1/completions", {"model": DEFAULT_MODEL, "prompt": "hi", field: value})
    assert status == 400 and message in json.loads(body)["error"]["message"]


def test_logit_bias_forces_and_bans_tokens(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=64)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
    assert llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0].token_ids == [7] * 6
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={t: -100.0 for t in plain})
    assert not set(llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids) & set(plain)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
    assert llm.generate(prompt, sampled, use_tqdm=False)[0].outputs[0].token_ids == [7] * 6


def test_vllm_extras_reach_the_sampling_params() -> None:
    import msgspec

    body = {"prompt": "x", "stop_token_ids": [5], "skip_special_tokens": False, "include_stop_str_in_output": True}
    request = msgspec.json.decode(json.dumps(body | {"logit_bias": {"4": -2.5}}), type=CompletionRequest)
    params = request.sampling_params(8, None)
    assert params.stop_token_ids == [5] and not params.skip_special_tokens and params.include_stop_str_in_output
    assert params.logit_bias == {4: -2.5}


def _prepared(body: dict, chat: bool) -> tuple[str, list[int], SamplingParams]:
    """The prompt text, ids and sampling params the gateway builds for a request body."""
    import msgspec

    from cadenza.gateway.openai_http import OpenAIHttp

    app = build_app(PacedEngine(pace=0.001), DEFAULT_MODEL, GatewaySettings())
    state = app.state.gateway
    kind = ChatCompletionRequest if chat else CompletionRequest
    ids, params, _ = OpenAIHttp(state)._prepare(msgspec.json.decode(json.dumps(body), type=kind), chat)
    return state.tokenizer.decode(ids, skip_special_tokens=False), ids, params


def test_vllm_chat_template_extras_shape_the_prompt() -> None:
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    text, _, _ = _prepared({"messages": turns, "add_generation_prompt": False, "continue_final_message": True}, True)
    assert text.endswith("The colour is")  # continued, not closed with an end-of-turn
    closed, _, _ = _prepared({"messages": turns, "add_generation_prompt": False}, True)
    assert closed.rstrip().endswith("<|im_end|>")
    opened, _, _ = _prepared({"messages": turns[:1]}, True)
    assert opened.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set messages"):
        _prepared({"messages": turns[:1], "chat_template_kwargs": {"messages": []}}, True)


def test_truncate_prompt_tokens_and_allowed_token_ids() -> None:
    _, whole, _ = _prepared({"prompt": "one two three four five six"}, False)
    _, last, params = _prepared({"prompt": "one two three four five six", "truncate_prompt_tokens": 3}, False)
    assert last == whole[-3:]
    _, _, params = _prepared({"prompt": "x", "allowed_token_ids": [5, 9]}, False)
    assert params.allowed_token_ids == [5, 9]


def test_allowed_token_ids_limit_what_is_sampled(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=64)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=8, allowed_token_ids=[4, 8])
        assert set(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) <= {4, 8}
