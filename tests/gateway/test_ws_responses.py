"""`cadenza serve` driven over /v1/responses: the openai package and bare websockets."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import websockets
from cadenza_testkit.servers import API_KEY, MAX_FRAME_BYTES
from openai import AsyncOpenAI
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
# The SDK itself falls back to unvalidated models; the tests validate strictly.
SERVER_EVENT = TypeAdapter(ResponsesServerEvent)


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.http + "/v1", api_key=API_KEY)


def _greedy(smollm, questions: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = smollm.chat([[{"role": "user", "content": q}] for q in questions], params)
    return [o.outputs[0].text for o in outs]


async def _until_terminal(conn, lanes: int = 1) -> tuple[dict[str | None, str], list]:
    texts: dict[str | None, str] = {}
    events, done = [], 0
    async for ev in conn:
        events.append(ev)
        if ev.type == "response.output_text.delta":
            texts[ev.stream_id] = texts.get(ev.stream_id, "") + ev.delta
        if ev.type in TERMINAL or ev.type == "error":
            done += 1
            if done == lanes:
                break
    return texts, events


@pytest.mark.slow
def test_openai_sdk_text_equals_engine_greedy_and_two_lanes_interleave(server, smollm) -> None:
    questions = ["What is the capital of France?", "Name three colours."]
    expected = _greedy(smollm, questions, 24)

    async def run() -> tuple[dict, list]:
        async with _client(server).responses.connect() as conn:
            for lane, q in zip("ab", questions):
                await conn.response.create(model=MODEL, input=q, temperature=0, max_output_tokens=24, stream_id=lane)
            return await _until_terminal(conn, lanes=2)

    texts, events = asyncio.run(run())
    assert texts == {"a": expected[0], "b": expected[1]}
    lanes = [ev.stream_id for ev in events if ev.type == "response.output_text.delta"]
    first_done = next(i for i, ev in enumerate(events) if ev.type in TERMINAL)
    assert {"a", "b"} <= set(lanes[: sum(1 for ev in events[:first_done] if ev.type.endswith("delta"))])
    seqs = [ev.sequence_number for ev in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    kinds = [ev.type for ev in events if ev.stream_id == "a"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert (
        kinds[-4:]
        == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            kinds[-1],
        ]
        and kinds[-1] in TERMINAL
    )


@pytest.mark.slow
def test_previous_response_id_continues_through_the_prefix_cache(server, smollm) -> None:
    async def run() -> tuple:
        async with _client(server).responses.connect() as conn:
            await conn.response.create(
                model=MODEL, input="My name is Ada. Say hello.", temperature=0, max_output_tokens=16
            )
            _, events = await _until_terminal(conn)
            first = events[-1].response
            hits_before = server.engine_stats()["kv_cache"]["hits"]
            await conn.response.create(
                input="What is my name?", previous_response_id=first.id, temperature=0, max_output_tokens=16
            )
            texts, events = await _until_terminal(conn)
            return first, events[-1].response, hits_before, texts

    first, second, hits_before, texts = asyncio.run(run())
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first turn's blocks
    assert server.engine_stats()["kv_cache"]["hits"] - hits_before >= 16
    # The same conversation rendered in one piece gives the same greedy reply.
    params = SamplingParams(temperature=0, max_tokens=16)
    conversation = [
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output[0].content[0].text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert texts[None] == smollm.chat(conversation, params)[0].outputs[0].text


@pytest.mark.slow
def test_steer_ends_the_response_steered_and_a_successor_continues(server) -> None:
    async def run() -> list:
        async with _client(server).responses.connect() as conn:
            await conn.response.create(
                model=MODEL, input="Write a long story about a dragon.", temperature=0, max_output_tokens=200
            )
            events, steered = [], None
            async for ev in conn:
                events.append(ev)
                if ev.type == "response.output_text.delta" and steered is None:
                    steered = events[0].response.id
                    await conn.response.steer(input="Make the dragon friendly.", previous_response_id=steered)
                if ev.type in TERMINAL and ev.response.id != steered:
                    return events
        return events

    events = asyncio.run(run())
    kinds = [ev.type for ev in events]
    assert "response.steer.accepted" in kinds
    incomplete = next(ev for ev in events if ev.type == "response.incomplete")
    assert incomplete.response.incomplete_details.reason == "steered"
    successor = [ev for ev in events if ev.type == "response.created"][1].response
    assert successor.previous_response_id == incomplete.response.id
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.id == successor.id and events[-1].response.output[0].content[0].text


@pytest.mark.slow
def test_closed_socket_aborts_and_frees_blocks(server) -> None:
    idle = server.engine_stats()["kv_cache"]["num_blocks"]

    async def run() -> None:
        async with websockets.connect(server.ws, additional_headers=AUTH) as ws:
            for lane in ("x", "y"):
                create = {"type": "response.create", "input": "Tell a very long tale.", "max_output_tokens": 400}
                await ws.send(json.dumps({**create, "stream_id": lane}))
            deltas = 0
            while deltas < 6:
                deltas += json.loads(await ws.recv())["type"] == "response.output_text.delta"
        # the socket is closed here, mid-stream

    asyncio.run(run())
    deadline = time.monotonic() + 15
    while True:
        stats = server.engine_stats()
        free = stats["kv_cache"]["num_free_blocks"] + stats["num_pinned_blocks"]  # earlier tests' conversations
        if stats["num_running"] == stats["num_waiting"] == 0 and free == idle:
            break
        assert time.monotonic() < deadline, f"blocks still held: {stats}"
        time.sleep(0.2)
    assert server.get("/stats")["gateway"]["in_flight"] == 0


async def _first_event(ws_url: str, frame: str | bytes | None, headers: dict | None = None) -> dict:
    """The first event after sending frame (None: a refused handshake speaks first)."""
    async with websockets.connect(ws_url, additional_headers=headers or AUTH, max_size=None) as ws:
        if frame is not None:
            await ws.send(frame)
        return json.loads(await ws.recv())


@pytest.mark.slow
def test_bad_input_gets_clear_errors_while_another_stream_goes_on(server, smollm) -> None:
    expected = _greedy(smollm, ["List the planets of the solar system."], 48)[0]
    create = {"type": "response.create", "input": "hi"}
    cases = {
        "malformed": ("{not json", "invalid_event"),
        "unknown type": (json.dumps({"type": "response.explode"}), "unknown_event_type"),
        "mistyped": (json.dumps({**create, "max_output_tokens": "many"}), "invalid_event"),
        "over-size": (json.dumps({**create, "input": "x" * (MAX_FRAME_BYTES + 10)}), "frame_too_large"),
        "over context": (json.dumps({**create, "input": "word " * 9000}), "context_length_exceeded"),
        "max_output_tokens < 1": (json.dumps({**create, "max_output_tokens": 0}), "invalid_event"),
        "unknown model": (json.dumps({**create, "model": "gpt-9"}), "model_not_found"),
        "unknown previous": (
            json.dumps({**create, "previous_response_id": "resp_nope"}),
            "previous_response_not_found",
        ),
        "cancel unknown": (json.dumps({"type": "response.cancel", "response_id": "resp_nope"}), "response_not_found"),
    }

    async def good_stream() -> str:
        async with _client(server).responses.connect() as conn:
            await conn.response.create(
                input="List the planets of the solar system.", temperature=0, max_output_tokens=48
            )
            texts, _ = await _until_terminal(conn)
            return texts[None]

    async def run() -> tuple[str, dict, list]:
        good = asyncio.ensure_future(good_stream())
        errors = {}
        for name, (frame, _) in cases.items():
            errors[name] = await _first_event(server.ws, frame)
        refused = [
            await _first_event(server.ws, None, {"Authorization": "Bearer wrong"}),
            await _first_event(server.ws, None, {**AUTH, "Origin": "http://evil.example"}),
        ]
        return await good, errors, refused

    text, errors, refused = asyncio.run(run())
    assert text == expected
    for name, (_, code) in cases.items():
        assert errors[name]["type"] == "error", name
        SERVER_EVENT.validate_python(errors[name])
        assert errors[name]["error"]["code"] == code, (name, errors[name])
        assert errors[name]["error"]["message"], name
    assert errors["mistyped"]["error"]["message"].endswith("$.max_output_tokens`")
    assert [r["error"]["code"] for r in refused] == ["invalid_api_key", "origin_not_allowed"]


@pytest.mark.slow
def test_64_concurrent_responses_complete_with_correct_text(server, smollm) -> None:
    questions = [f"Say the number {i} in words." for i in range(64)]
    expected = _greedy(smollm, questions, 12)

    async def socket_of_8(batch: list[tuple[int, str]]) -> dict[int, str]:
        async with websockets.connect(server.ws, additional_headers=AUTH) as ws:
            for i, q in batch:
                await ws.send(
                    json.dumps(
                        {
                            "type": "response.create",
                            "input": q,
                            "temperature": 0,
                            "max_output_tokens": 12,
                            "stream_id": str(i),
                        }
                    )
                )
            texts, done = {i: "" for i, _ in batch}, 0
            while done < len(batch):
                ev = json.loads(await ws.recv())
                assert ev["type"] != "error", ev
                assert SERVER_EVENT.validate_python(ev).type == ev["type"]  # strict, the SDK's own models
                if ev["type"] == "response.output_text.delta":
                    texts[int(ev["stream_id"])] += ev["delta"]
                done += ev["type"] in TERMINAL
            return texts

    async def run() -> dict[int, str]:
        indexed = list(enumerate(questions))
        parts = await asyncio.gather(*(socket_of_8(indexed[k : k + 8]) for k in range(0, 64, 8)))
        return {i: t for part in parts for i, t in part.items()}

    texts = asyncio.run(run())
    assert [texts[i] for i in range(64)] == expected
