"""Reasoning models (`--reasoning-parser`): the thinking between <think> and </think> is
`reasoning_content`, the rest `content`, streamed and whole, through the `openai` package; the
thinking's tokens are usage.completion_tokens_details.reasoning_tokens. The splitter is held to
one rule however the reply is cut into deltas (hypothesis), including a tag cut in pieces."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread
from hypothesis import example, given
from hypothesis import strategies as st

from cadenza.gateway.app import build_app
from cadenza.gateway.reasoning import ReasoningSplitter, split_whole
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL
from cadenza.outputs import CompletionOutput, RequestMetrics, RequestOutput

REPLY = ["<th", "ink>\n", "Two", " plus", " two.", "</", "think>\n\n", "It", " is", " 4."]


class ScriptedEngine(PacedEngine):
    """Streams REPLY, one delta (one token) per piece, then stops."""

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[RequestOutput]:
        for i, piece in enumerate(REPLY):
            await asyncio.sleep(0)
            last = i == len(REPLY) - 1
            out = CompletionOutput(0, piece, [100 + i], None, None, "stop" if last else None)
            yield RequestOutput(request_id, None, [], None, [out], last, 0, [RequestMetrics(time.time())])


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    settings = GatewaySettings(port=free_port(), reasoning_parser="qwen3")
    with serve_in_thread(build_app(ScriptedEngine(0.0), DEFAULT_MODEL, settings), settings.port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{settings.port}/v1", api_key="none")


def _ask(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "2+2?"}], **extra)


def test_a_whole_reply_has_its_thinking_apart(client: openai.OpenAI) -> None:
    reply = _ask(client)
    message = reply.choices[0].message
    assert message.content == "It is 4." and message.model_extra["reasoning_content"] == "Two plus two."
    # The deltas from the opening tag's second half to the closing tag's end are thinking.
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6
    assert reply.usage.completion_tokens == len(REPLY)


def test_a_streamed_reply_sends_thinking_then_content(client: openai.OpenAI) -> None:
    chunks = list(_ask(client, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (thinking, content) == ("Two plus two.", "It is 4.")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 6


def test_a_bad_parser_name_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1, auto or none"):
        GatewaySettings(reasoning_parser="o1")


QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
R1_LIKE = (
    "{% for m in messages %}<|User|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)


def test_the_parser_is_recognised_from_the_chat_template() -> None:
    from cadenza.gateway.reasoning import parser_for

    assert parser_for(QWEN3_LIKE, "auto") == "qwen3"
    assert parser_for(R1_LIKE, "auto") == "deepseek_r1"
    assert parser_for("{{ messages[0].content }}", "auto") == ""  # no thinking in the template
    assert parser_for(None, "auto") == "" and parser_for(R1_LIKE, "none") == ""
    assert parser_for(QWEN3_LIKE, "deepseek_r1") == "deepseek_r1"  # named wins


@pytest.mark.parametrize(
    ("parser", "reply", "expected"),
    [
        ("qwen3", "<think>a</think>b", ("a", "b")),
        ("qwen3", "no thinking here", ("", "no thinking here")),
        ("qwen3", "\n<think>\nx\n</think>\n\ny", ("x\n", "y")),
        ("deepseek_r1", "pondering</think>answer", ("pondering", "answer")),
        ("deepseek_r1", "<think>p</think>a", ("p", "a")),
        ("qwen3", "<think>cut short", ("cut short", "")),
        ("qwen3", "<thin", ("", "<thin")),  # an unfinished tag at the end is text
        ("qwen3", "a < b </thin", ("", "a < b </thin")),
    ],
)
def test_whole_replies(parser: str, reply: str, expected: tuple[str, str]) -> None:
    assert split_whole(parser, reply) == expected


@given(
    parser=st.sampled_from(["qwen3", "deepseek_r1"]),
    reply=st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n"]), max_size=12).map(
        "".join
    ),
    cuts=st.lists(st.integers(0, 80), max_size=6),
)
@example(parser="qwen3", reply="<think></think>\n\na", cuts=[15, 16])  # newlines after a tag, cut apart
@example(parser="qwen3", reply="<think>\nx</think>", cuts=[7])
def test_any_cut_into_deltas_splits_as_the_whole(parser: str, reply: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(reply), *(c % (len(reply) + 1) for c in cuts)})
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for start, end in zip(bounds, bounds[1:]):
        r, c = splitter.feed(reply[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == split_whole(parser, reply)


def test_the_splitter_is_linear_in_the_reply() -> None:
    """A long thinking run fed token by token holds back at most a tag's length each time."""
    splitter = ReasoningSplitter("qwen3")
    splitter.feed("<think>")
    total = sum(len(splitter.feed("<" + "x" * 7)[0]) for _ in range(20000))
    assert total == 20000 * 8 and len(splitter.held) < len("</think>")


def test_a_response_carries_its_thinking_as_a_reasoning_item(client: openai.OpenAI) -> None:
    """The Responses API: a reasoning item (reasoning_text) before the message, its tokens in
    usage.output_tokens_details.reasoning_tokens."""
    response = client.responses.create(model=DEFAULT_MODEL, input="2+2?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two plus two."
    assert message.type == "message" and response.output_text == "It is 4."
    assert response.usage.output_tokens_details.reasoning_tokens == 6


def test_a_streamed_response_sends_reasoning_events_then_the_answer(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=DEFAULT_MODEL, input="2+2?", stream=True))
    kinds = [e.type for e in events]
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, answer) == ("Two plus two.", "It is 4.")
    # The reasoning item opens (output 0) and closes before the message opens (output 1).
    opened = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert opened == [(0, "reasoning"), (1, "message")]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert events[-1].type == "response.completed"


@pytest.mark.slow
def test_the_chat_page_folds_the_thinking_above_the_answer() -> None:
    from cadenza_testkit.browser import CHROMIUM_ARGS, chromium_path
    from playwright.sync_api import expect, sync_playwright

    settings = GatewaySettings(port=free_port(), reasoning_parser="qwen3")
    with serve_in_thread(build_app(ScriptedEngine(0.0), DEFAULT_MODEL, settings), settings.port):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{settings.port}/")
                expect(page.locator("#status")).to_have_text("connected", timeout=30_000)
                page.fill("#input", "2+2?")
                page.keyboard.press("Enter")
                reply = page.locator(".msg.assistant").nth(0)
                expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=30_000)
                thought = page.locator("details.think")
                assert thought.get_attribute("open") is None  # folded
                assert thought.locator("div").text_content() == "Two plus two."
                assert reply.inner_text().startswith("It is 4.")
            finally:
                browser.close()
