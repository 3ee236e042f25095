"""The Responses API over HTTP with the official client: whole and streamed, background
responses, resuming a cut stream with starting_after (HTTP and websocket), cancel; and the
response log's bounds."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import openai
import pytest
import websockets
from cadenza_testkit.servers import API_KEY, Server
from cadenza_testkit.waiting import until

from cadenza.gateway.response_events import ReplayError, ResponseLogs

MODEL = "SmolLM2-135M-Instruct"
STORY = "Tell me a short story about a lighthouse keeper."
TOKENS = 48


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY)


def _text(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


@pytest.fixture(scope="module")
def uncut(client: openai.OpenAI) -> str:
    whole = client.responses.create(model=MODEL, input=STORY, temperature=0, max_output_tokens=TOKENS)
    assert whole.output_text
    return whole.output_text


@pytest.mark.slow
def test_streamed_and_whole_are_the_same_reply(client: openai.OpenAI, uncut: str) -> None:
    events = list(
        client.responses.create(model=MODEL, input=STORY, temperature=0, max_output_tokens=TOKENS, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _text(events) == uncut
    stored = client.responses.retrieve(events[0].response.id)
    assert stored.output_text == uncut and stored.status == "incomplete"


@pytest.mark.slow
def test_cut_background_stream_resumes_with_exactly_the_uncut_text(client: openai.OpenAI, uncut: str) -> None:
    stream = client.responses.create(
        model=MODEL, input=STORY, temperature=0, max_output_tokens=TOKENS, stream=True, background=True
    )
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) > 10:
            break
    stream.close()  # the connection drops mid-reply; a background response runs on
    response_id, last = seen[0].response.id, seen[-1].sequence_number
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
    assert rest[0].sequence_number == last + 1 and rest[-1].type == "response.incomplete"
    assert _text(seen + rest) == uncut
    again = list(
        client.responses.retrieve(response_id, stream=True, starting_after=2)
    )  # any point, any number of times
    assert _text(seen[:3] + again) == uncut


@pytest.mark.slow
def test_cut_websocket_background_response_resumes_over_http(server: Server, client: openai.OpenAI, uncut: str) -> None:
    create = {"type": "response.create", "input": STORY, "temperature": 0, "max_output_tokens": TOKENS}

    async def cut() -> list[dict]:
        events = []
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with websockets.connect(server.ws, additional_headers=headers) as ws:
            await ws.send(json.dumps({**create, "background": True}))
            async for frame in ws:
                events.append(json.loads(frame))
                if events[-1]["type"] == "response.output_text.delta" and len(events) > 8:
                    break  # and the socket closes here, mid-reply
        return events

    seen = asyncio.run(cut())
    response_id = seen[0]["response"]["id"]
    # A socket's first response: its events' numbers on the socket are the response's own.
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=len(seen) - 1))
    text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta") + _text(rest)
    assert text == uncut and rest[-1].type == "response.incomplete"


def test_background_response_is_cancelled_and_retrieved(client: openai.OpenAI) -> None:
    started = client.responses.create(model=MODEL, input=STORY, max_output_tokens=400, background=True)
    assert started.status == "in_progress" and started.background
    for event in client.responses.retrieve(started.id, stream=True):
        if event.type == "response.output_text.delta":
            break  # producing text: cancel it mid-run
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"


def test_unknown_ids_and_bad_resume_points_are_clear_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve("resp_nope")
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="starting_after 999"):
        list(client.responses.retrieve(done.id, stream=True, starting_after=999))
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(model=MODEL, input="", max_output_tokens=2)


def test_previous_response_id_continues_over_http(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=8)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, temperature=0, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn came from the prefix cache


def test_response_log_bounds() -> None:
    async def run() -> None:
        logs = ResponseLogs(max_size=2, ttl_s=60, max_events=3)
        a, b = logs.open("a"), logs.open("b")
        a.finish()
        logs.open("c")  # over max_size: the oldest finished one goes, running ones stay
        assert logs.get("a") is None and logs.get("b") is b and len(logs) == 2
        for i in range(5):
            b.append({"type": "x", "i": i})
        assert [json.loads(data)["sequence_number"] for _, data in b.events] == [0, 1, 2] and b.overflowed
        with pytest.raises(ReplayError, match="response_log_max_events"):
            [e async for e in b.follow(0)]
        logs.ttl_s = 0
        b.finish()
        await until(lambda: logs.get("b") is None, "a finished log past its TTL is dropped")

    asyncio.run(run())


def test_response_log_is_bounded_in_bytes() -> None:
    """Each response within its own share (past it, it streams on unrecorded), all together
    within the total: the oldest finished go first, and running ones past it stop recording."""
    big = "x" * 10_000  # an event of ~10 KB

    async def run() -> None:
        logs = ResponseLogs(max_size=100, ttl_s=60, max_events=10**6, max_bytes=200_000, max_response_bytes=50_000)
        first = logs.open("first")
        numbered = [first.append({"type": "delta", "delta": big}) for _ in range(10)]
        assert [e["sequence_number"] for e in numbered] == list(range(10))  # every event still streams
        assert len(first.events) == 4 and first.overflowed and first.bytes <= 50_000
        first.finish()
        for i in range(10):
            log = logs.open(f"r{i}")
            for _ in range(4):
                log.append({"type": "delta", "delta": big})
            log.finish()
            assert logs.bytes <= 200_000 and not log.overflowed
        assert logs.get("first") is None and logs.get("r9") is not None  # the oldest finished went first
        live = [logs.open(f"live{i}") for i in range(6)]
        for log in live:
            for _ in range(4):
                log.append({"type": "delta", "delta": big})
        assert logs.bytes <= 200_000 and not live[0].overflowed and live[-1].overflowed
        assert all(logs.get(f"live{i}") is log for i, log in enumerate(live))  # running: never dropped
        assert sum(log.bytes for log in live) == logs.bytes

    asyncio.run(run())


def test_response_log_memory_stays_under_its_bound_with_large_bodies() -> None:
    """Measured, not estimated: what the logs hold, in Python's own allocations."""
    bound = 4_000_000
    big, small = "y" * 300_000, "z"
    deltas = [{"type": "response.output_text.delta", "delta": small, "cadenza": {"token_ids": [7]}}] * 4000

    async def run() -> ResponseLogs:
        logs = ResponseLogs(max_size=256, ttl_s=60, max_events=10**6, max_bytes=bound, max_response_bytes=bound // 2)
        for i in range(40):  # 40 x (3 echoes of a 300 KB request + 4000 token events)
            log = logs.open(f"r{i}")
            for kind in ("response.created", "response.in_progress"):
                log.append({"type": kind, "response": {"id": f"r{i}", "instructions": big}})
            for delta in deltas:
                log.append(delta)
            log.append({"type": "response.completed", "response": {"id": f"r{i}", "instructions": big}})
            log.finish()
        return logs

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        logs = asyncio.run(run())
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert logs.bytes <= bound and held <= bound * 1.1
