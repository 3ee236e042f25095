"""The tool_choice=auto parsers on recorded model outputs (the shapes Qwen/Hermes, Llama 3
and Mistral models emit), whole and streamed in chunks of every size, and the prompt a
tool-result turn renders to."""

from __future__ import annotations

import json

import msgspec
import pytest

from cadenza.gateway.openai_schema import ChatCompletionRequest
from cadenza.gateway.tool_calls import StreamParser, parse, parser_for
from cadenza.gateway.tool_choice import ToolDeltas, ToolPlan, messages, plan
from cadenza.models.chat_template import render_chat
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
TIME = {"name": "get_time", "arguments": {"zone": "CET"}}
# (parser, recorded output, content expected, calls expected)
RECORDED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me check.",
        [WEATHER, TIME],
    ),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', "", [TIME]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "", [WEATHER]),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
        [WEATHER, TIME],
    ),
    ("llama3", "The weather is {sunny} today.", "The weather is {sunny} today.", []),
    ("llama3", "{not json at all", "{not json at all", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "",
        [WEATHER, TIME],
    ),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure.", [TIME]),
    ("mistral", "Plain [TOOL answer] here.", "Plain [TOOL answer] here.", []),
]


def _as_dicts(calls: list) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", RECORDED)
def test_whole_reply_parses(parser: str, text: str, content: str, calls: list[dict]) -> None:
    got_content, got_calls = parse(parser, text)
    assert _as_dicts(got_calls) == calls
    assert got_content.strip() == content


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser,text,content,calls", RECORDED)
def test_streamed_reply_parses_the_same(parser: str, text: str, content: str, calls: list[dict], chunk: int) -> None:
    stream = StreamParser(parser)
    got_content, got_calls = "", []
    for at in range(0, len(text), chunk):
        part, found = stream.feed(text[at : at + chunk])
        got_content, got_calls = got_content + part, got_calls + found
    part, found = stream.finish()
    got_content, got_calls = got_content + part, got_calls + found
    assert _as_dicts(got_calls) == calls
    assert got_content.strip() == content


def test_hermes_streams_content_before_a_call_at_once() -> None:
    stream = StreamParser("hermes")
    assert stream.feed("Checking the weather now <tool") == ("Checking the weather now ", [])
    assert stream.feed("_call>") == ("", [])
    content, calls = stream.feed('{"name": "get_time", "arguments": {}}</tool_call> done')
    assert content == " done" and [c.name for c in calls] == ["get_time"]


def test_deltas_number_calls_and_respect_parallel_false() -> None:
    text = RECORDED[0][1]
    deltas = ToolDeltas(ToolPlan("auto", "hermes", parallel=False))
    out = deltas.feed(text) + deltas.finish()
    calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
    named = ToolDeltas(ToolPlan("named", "hermes", name="get_time"))
    parts = named.feed('{"zone"') + named.feed(': "CET"}') + named.finish()
    assert parts[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert "".join(p["tool_calls"][0]["function"]["arguments"] for p in parts) == '{"zone": "CET"}'


def test_parser_is_recognised_from_the_template() -> None:
    assert parser_for("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for("{{ '<|python_tag|>' }}") == "llama3"
    assert parser_for("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert parser_for(None) == "hermes"
    assert parser_for("x", "llama3") == "llama3"
    with pytest.raises(ValueError, match="tool_call_parser"):
        parser_for("x", "nope")


PARIS = '{"city": "Paris"}'
TOOL_TURN = {
    "model": DEFAULT_MODEL,
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ],
}


def _body(extra: dict | None = None) -> ChatCompletionRequest:
    return msgspec.json.decode(json.dumps({**TOOL_TURN, **(extra or {})}), type=ChatCompletionRequest)


def test_tool_result_turn_renders_through_smollm_template() -> None:
    """SmolLM2's template knows no tools: the hermes format is taught and written back."""
    tokenizer = load_tokenizer(*read_model(DEFAULT_MODEL))
    body = _body()
    tool_plan, shown = plan(body, "hermes")
    turns, variables = messages(body, shown, tokenizer.chat_template)
    text = tokenizer.apply_chat_template(turns, True, variables)
    assert tool_plan is not None and tool_plan.mode == "auto" and variables == {}
    assert "<tools>" in text and '"name": "get_weather"' in text  # the tools, in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


NATIVE = (
    "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endif %}"
    "{{ m.content or '' }}{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


def test_tool_turns_reach_a_template_that_knows_tools() -> None:
    body = _body()
    _, shown = plan(body, "hermes")
    turns, variables = messages(body, shown, NATIVE)
    text = render_chat(NATIVE, turns, True, **variables)
    # (trim_blocks, as transformers renders, eats the newline after each endif)
    assert (
        text
        == 'TOOL get_weather\n[user]Weather in Paris?[assistant]CALL get_weather(Paris)[tool]{"temp_c": 18} for call_1'
    )


def test_tool_choice_none_leaves_tools_out_and_bad_choices_are_400() -> None:
    assert plan(_body({"tool_choice": "none"}), "hermes") == (None, [])
    with pytest.raises(ValueError, match="not among the tools"):
        plan(_body({"tool_choice": {"type": "function", "function": {"name": "nope"}}}), "hermes")
    with pytest.raises(ValueError, match="tool_choice must be"):
        plan(_body({"tool_choice": "sometimes"}), "hermes")
    legacy = _body({"tools": None, "functions": [{"name": "get_weather"}], "function_call": {"name": "get_weather"}})
    tool_plan, _ = plan(legacy, "hermes")
    assert tool_plan is not None and (tool_plan.mode, tool_plan.name) == ("named", "get_weather")


def test_responses_tools_and_items_are_refused_with_their_reason() -> None:
    from cadenza.gateway.protocol import InputMessage, ResponseCreate, input_messages
    from cadenza.gateway.state import as_chat_request

    with pytest.raises(ValueError, match="only tools of type function"):
        as_chat_request(ResponseCreate(input="hi", tools=[{"type": "web_search_preview"}]), [])
    with pytest.raises(ValueError, match="unsupported input item type 'reasoning'"):
        input_messages([InputMessage(type="reasoning")])
    turns = input_messages(
        [
            InputMessage(role="user", content="hi"),
            InputMessage(type="function_call", call_id="c1", name="f", arguments="{}"),
            InputMessage(type="function_call", call_id="c2", name="g", arguments="{}"),
            InputMessage(type="function_call_output", call_id="c1", output="1"),
        ]
    )
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]  # the two calls share one turn
    assert [c["id"] for c in turns[1]["tool_calls"]] == ["c1", "c2"]


def test_json_schema_true_and_false() -> None:
    from cadenza.structured_outputs import StructuredOutputs

    assert StructuredOutputs(json=True).json == {}  # any JSON value
    with pytest.raises(ValueError, match="matches nothing"):
        StructuredOutputs(json=False)


def test_a_required_reply_missing_keys_is_read_not_a_crash() -> None:
    """tool_choice="required": the grammar asks for name and arguments, but the reply is read
    defensively: a call without arguments gets {}, an item without a name is dropped."""
    content, calls = ToolPlan("required", "hermes").parse('[{"name": "f"}, {"arguments": {}}, 3]')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
