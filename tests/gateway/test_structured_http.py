"""Structured output and tool calls through `cadenza serve` (SmolLM2, n-gram speculation
on, the model on a worker), with the official `openai` package."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from cadenza_testkit.servers import API_KEY, Server

MODEL = "SmolLM2-135M-Instruct"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "capital"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Accra", "Hanoi"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY)


def _city_json(client: openai.OpenAI, prompt: str, temperature: float) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=temperature, seed=7,
        max_tokens=120, response_format=fmt,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    return reply.choices[0].message.content


@pytest.mark.slow
def test_json_schema_replies_validate_for_20_prompts(client: openai.OpenAI) -> None:
    prompts = [(f"Describe {c} as JSON.", t) for c in CITIES for t in (0.0, 1.0)]
    with ThreadPoolExecutor(4) as pool:  # batched with each other, as a server sees them
        replies = list(pool.map(lambda pt: _city_json(client, *pt), prompts))
    for text in replies:
        jsonschema.validate(json.loads(text), CITY)


def test_json_object_and_bad_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about cats."}], temperature=0,
        max_tokens=60, response_format={"type": "json_object"}, extra_body={"guided_json": None},
    )  # fmt: skip
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectz"}}}
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema: Invalid type: objectz"):
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="one output format"):
        client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, response_format={"type": "json_object"},
            extra_body={"guided_regex": "[a-z]+"},
        )  # fmt: skip


def test_completions_take_vllm_guided_fields(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert reply.choices[0].text in ("yes", "no")
    reply = client.completions.create(
        model=MODEL, prompt="A date:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )  # fmt: skip
    assert len(reply.choices[0].text) == 10 and reply.choices[0].text.startswith("20")


def _arguments_valid(arguments: str) -> dict:
    value = json.loads(arguments)
    jsonschema.validate(value, WEATHER["function"]["parameters"])
    return value


@pytest.mark.slow
def test_named_tool_choice_returns_valid_arguments_whole_and_streamed(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kwargs)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = _arguments_valid(call.function.arguments)
    assert whole.choices[0].message.content is None and whole.choices[0].finish_reason == "stop"
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments


@pytest.mark.slow
def test_required_tool_choice_calls_a_listed_function(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80,
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    _arguments_valid(calls[0].function.arguments)


def test_tool_result_turn_is_answered(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER], temperature=0, max_tokens=24)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 100  # the tools and the result


async def _ws_response(server: Server, **create) -> tuple[list, dict]:
    """Every event of one response over the websocket (validated as the SDK's models), and
    the final response object."""
    client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key=API_KEY)
    events = []
    async with client.responses.connect() as conn:
        await conn.response.create(model=MODEL, temperature=0, **create)
        async for ev in conn:
            events.append(ev)
            if ev.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                break
    return events, events[-1].response


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.mark.slow
def test_websocket_text_format_and_function_calls(server: Server) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    events, response = asyncio.run(
        _ws_response(server, input="Describe Oslo as JSON.", text=fmt, max_output_tokens=120)
    )
    jsonschema.validate(json.loads(response.output_text), CITY)
    named = {"type": "function", "name": "get_weather"}
    events, response = asyncio.run(
        _ws_response(server, input=ASK_WEATHER, tools=[FLAT_WEATHER], tool_choice=named, max_output_tokens=60)
    )
    call = next(item for item in response.output if item.type == "function_call")
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    _arguments_valid(call.arguments)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and response.status == "completed"
    turn = [
        *ASK_WEATHER,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'},
    ]
    _, answer = asyncio.run(_ws_response(server, input=turn, tools=[FLAT_WEATHER], max_output_tokens=16))
    assert answer.status in ("completed", "incomplete") and answer.output_text
    assert answer.usage.input_tokens > 100  # the tools and the tool turns were rendered


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=16)
    assert "Paris" in plain.choices[0].message.content
    banned = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, max_tokens=16, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in banned.choices[0].message.content


def test_chat_prompt_logprobs_equal_the_engines(client: openai.OpenAI, smollm) -> None:
    from cadenza import SamplingParams

    ask = [{"role": "user", "content": "Hello there!"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    served = reply.model_extra["prompt_logprobs"]
    engine = smollm.chat([ask], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert served[0] is None and len(served) == len(engine.prompt_token_ids)
    for token, position, expected in zip(engine.prompt_token_ids[1:], served[1:], engine.prompt_logprobs[1:]):
        assert position[str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-3)
        assert position[str(token)]["rank"] == expected[token].rank
