"""Priority and sessions from the wire to the engine: the `priority` field, the `x-priority`
header, `service_tier: "flex"` as batch work, and the conversation each turn belongs to;
then, on SmolLM2 in-process, a pinned conversation keeps its prefix through a burst of
batch work between its turns."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import openai
import pytest
import websockets
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

HI = [{"role": "user", "content": "hi"}]
VIP = "vip-key"  # the fixture server's one priority_api_keys key
ENDS = ("error", "response.completed", "response.incomplete", "response.failed")  # a websocket response's last event


class RecordingEngine(PacedEngine):
    """PacedEngine that remembers how each request was queued."""

    def __init__(self) -> None:
        super().__init__(pace=0.001)
        self.queued: list[tuple[int, str | None]] = []

    async def generate(self, prompt: dict, params, request_id: str, **kw) -> AsyncIterator:  # noqa: ANN001, ANN003
        self.queued.append((kw.get("priority", 0), kw.get("session_id")))
        async for out in super().generate(prompt, params, request_id):
            yield out


@pytest.fixture(scope="module")
def recorded() -> Iterator[tuple[str, RecordingEngine]]:
    engine, port = RecordingEngine(), free_port()
    settings = GatewaySettings(port=port, batch_priority=7, priority_api_keys=(VIP,))
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), port):
        yield f"http://127.0.0.1:{port}", engine


def test_priority_comes_from_body_header_or_service_tier(recorded: tuple[str, RecordingEngine]) -> None:
    url, engine = recorded
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    ask = dict(model=DEFAULT_MODEL, messages=HI, max_tokens=1)
    client.chat.completions.create(**ask)
    openai.OpenAI(base_url=url + "/v1", api_key=VIP).chat.completions.create(**ask, extra_body={"priority": -3})
    client.chat.completions.create(**ask, extra_headers={"x-priority": "5"})
    client.chat.completions.create(**ask, service_tier="flex", prompt_cache_key="conv-9")
    client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=1, extra_body={"priority": 2})
    assert engine.queued[-5:] == [(0, None), (-3, None), (5, None), (7, "conv-9"), (2, None)]
    with pytest.raises(openai.BadRequestError, match="x-priority must be an integer"):
        client.chat.completions.create(**ask, extra_headers={"x-priority": "high"})


def test_responses_turns_share_their_conversation(recorded: tuple[str, RecordingEngine]) -> None:
    url, engine = recorded
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    first = client.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=1)
    second = client.responses.create(
        model=DEFAULT_MODEL, input="again", max_output_tokens=1, previous_response_id=first.id
    )
    client.responses.create(model=DEFAULT_MODEL, input="x", max_output_tokens=1, previous_response_id=second.id,
                            extra_body={"priority": 4})  # fmt: skip
    assert engine.queued[-3:] == [(0, first.id), (0, first.id), (4, first.id)]

    async def over_websocket() -> None:
        async with websockets.connect(url.replace("http", "ws") + "/v1/responses") as ws:
            await ws.send(
                json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 1, "service_tier": "flex"})
            )
            while json.loads(await ws.recv())["type"] not in ("response.completed", "response.incomplete"):
                pass

    asyncio.run(over_websocket())
    assert engine.queued[-1][0] == 7


@pytest.mark.slow
def test_pinned_conversation_keeps_its_prefix_through_batch_work() -> None:
    from cadenza.actors.inprocess_client import InProcessClient

    # 48 blocks of 16 tokens: the burst below needs more than the pool, so unpinned blocks go.
    engine = InProcessClient(DEFAULT_MODEL, num_blocks=48, max_pinned_fraction=0.5)
    port = free_port()
    try:
        with serve_in_thread(build_app(engine, DEFAULT_MODEL, GatewaySettings(port=port)), port):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            story = "Here is some context about lighthouses and the people who keep them. " * 12
            first = client.responses.create(model=DEFAULT_MODEL, input=story, temperature=0, max_output_tokens=8)
            burst = [f"Batch job {i}: " + "summarise the following numbers " * 14 + str(i) for i in range(8)]
            for prompt in burst:
                client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=4, service_tier="flex")  # fmt: skip
            second = client.responses.create(
                model=DEFAULT_MODEL, input="And who keeps them?", previous_response_id=first.id, max_output_tokens=4
            )
            cached = second.usage.input_tokens_details.cached_tokens
            assert cached >= (first.usage.input_tokens // 16) * 16  # the whole first prompt, block by block
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("where", "asked"),
    [
        ("body", 1001),
        ("body", -1001),
        ("body", 2**31 - 1),
        ("header", "1001"),
        ("header", "-1001"),
        ("header", str(2**63)),  # past int64: once a 500 from the engine's wire
        ("header", "9" * 30),
        ("header", "1_0"),
    ],
)
def test_priority_outside_its_range_is_a_400(recorded: tuple[str, RecordingEngine], where: str, asked) -> None:  # noqa: ANN001
    """Body and header share one range, [-1000, 1000], for every key (the priority key too)."""
    url, engine = recorded
    before = len(engine.queued)
    client = openai.OpenAI(base_url=url + "/v1", api_key=VIP, max_retries=0)
    ask = {"extra_body": {"priority": asked}} if where == "body" else {"extra_headers": {"x-priority": asked}}
    name = "priority" if where == "body" else "x-priority"
    with pytest.raises(openai.BadRequestError, match=rf"{name} must be an integer in \[-1000, 1000\]"):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=HI, max_tokens=1, **ask)
    with pytest.raises(openai.BadRequestError, match=rf"{name} must be an integer in \[-1000, 1000\]"):
        client.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=1, **ask)
    assert len(engine.queued) == before  # refused before the engine


def test_only_priority_keys_go_ahead_of_interactive_work(recorded: tuple[str, RecordingEngine]) -> None:
    url, engine = recorded
    ask = dict(model=DEFAULT_MODEL, messages=HI, max_tokens=1)
    anyone = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    before = len(engine.queued)
    for extra in ({"extra_body": {"priority": -1}}, {"extra_headers": {"x-priority": "-1000"}}):
        with pytest.raises(
            openai.BadRequestError, match="only an API key named in the server's priority_api_keys"
        ) as e:
            anyone.chat.completions.create(**ask, **extra)
        assert e.value.code == "priority_not_allowed" and e.value.param == "priority"
    with pytest.raises(openai.BadRequestError, match="priority_api_keys"):
        anyone.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=1, extra_body={"priority": -2})
    assert len(engine.queued) == before
    anyone.chat.completions.create(**ask, extra_body={"priority": 1000})  # below interactive: anyone's
    vip = openai.OpenAI(base_url=url + "/v1", api_key=VIP, max_retries=0)
    vip.chat.completions.create(**ask, extra_headers={"x-priority": "-1000"})
    vip.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=1, extra_body={"priority": -7})
    assert [p for p, _ in engine.queued[before:]] == [1000, -1000, -7]

    async def over_websocket(key: str) -> dict:
        headers = {"Authorization": f"Bearer {key}"}
        async with websockets.connect(url.replace("http", "ws") + "/v1/responses", additional_headers=headers) as ws:
            await ws.send(
                json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 1, "priority": -1})
            )
            while (event := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in ENDS:
                pass
            return event

    refused = asyncio.run(over_websocket("none"))
    assert refused["type"] == "error" and refused["error"]["code"] == "priority_not_allowed"
    assert asyncio.run(over_websocket(VIP))["type"] != "error" and engine.queued[-1][0] == -1


def test_priority_keys_are_settings_checked_in_constant_time() -> None:
    settings = GatewaySettings(api_key="shared", priority_api_keys=["vip"])  # a YAML list becomes a tuple
    assert settings.priority_api_keys == ("vip",)
    assert settings.key_accepts(["vip"]) and settings.key_accepts(["shared"]) and not settings.key_accepts(["x"])
    assert settings.grants_priority(["x", "vip"]) and not settings.grants_priority(["shared"])
    assert not GatewaySettings().grants_priority(["anything"])
    with pytest.raises(ValueError, match="priority_api_keys"):
        GatewaySettings(priority_api_keys="vip")  # one string is not a list of keys
    with pytest.raises(ValueError, match="batch_priority must be in"):
        GatewaySettings(batch_priority=2**40)


def test_serve_flags_name_priority_keys_and_aging() -> None:
    from cadenza.cli.main import build_parser
    from cadenza.engine_args import engine_kwargs
    from cadenza.gateway.server import settings_from_args

    args = build_parser().parse_args(["serve", "--priority-api-keys", "a", "b", "--priority-aging-s", "0"])
    assert settings_from_args(args).priority_api_keys == ("a", "b")  # whole keys, not their letters
    assert engine_kwargs(args)["priority_aging_s"] == 0.0
    defaults = build_parser().parse_args(["serve"])
    assert settings_from_args(defaults).priority_api_keys == () and engine_kwargs(defaults)["priority_aging_s"] == 1.0
