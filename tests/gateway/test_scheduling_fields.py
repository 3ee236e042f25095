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
from conftest import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

HI = [{"role": "user", "content": "hi"}]


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
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, GatewaySettings(port=port, batch_priority=7)), port):
        yield f"http://127.0.0.1:{port}", engine


def test_priority_comes_from_body_header_or_service_tier(recorded: tuple[str, RecordingEngine]) -> None:
    url, engine = recorded
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    ask = dict(model=DEFAULT_MODEL, messages=HI, max_tokens=1)
    client.chat.completions.create(**ask)
    client.chat.completions.create(**ask, extra_body={"priority": -3})
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
