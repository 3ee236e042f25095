"""Issue #14, the websocket side: every way a client could leak a slot, kill a lane or stall
the loop, each over a real uvicorn socket in this process (so the admission counters can be
read) with engine doubles: no model, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import websockets
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.state import GatewayState
from cadenza.models.chat_template import render_chat
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import CompletionOutput, RequestMetrics, RequestOutput

GUARD_S = 30  # hang guard only: every wait below ends on an event, never on a clock


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(*read_model(DEFAULT_MODEL))


class Engine(PacedEngine):
    """PacedEngine sharing one tokenizer, which can fail on cue or flood the socket."""

    def __init__(self, tokenizer: Any, pace: float = 0.02, chunk: str = "a") -> None:
        self.pace, self.tokenizer, self.chunk = pace, tokenizer, chunk
        self.running = 0
        self.problem: str | None = None
        self.fail_next = 0  # this many generate calls raise a plain RuntimeError

    async def generate(
        self, prompt: dict, params: Any, request_id: str, cache_salt: str | None = None, **_: Any
    ) -> AsyncIterator[RequestOutput]:  # **_: pace, which this double ignores
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("the engine double failed on cue")
        self.running += 1
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.pace)
                last = i == params.max_tokens - 1
                out = CompletionOutput(0, self.chunk, [42], None, None, "length" if last else None)
                yield RequestOutput(request_id, None, [], None, [out], last, 0, [RequestMetrics(0.0)])
        finally:
            self.running -= 1


@contextlib.contextmanager
def gateway(engine: Engine, **overrides: Any) -> Iterator[tuple[str, GatewayState]]:
    settings = GatewaySettings(port=free_port(), **overrides)
    app = build_app(engine, DEFAULT_MODEL, settings)
    with serve_in_thread(app, settings.port):
        yield f"ws://127.0.0.1:{settings.port}/v1/responses", app.state.gateway


def _create(lane: str | None = "a", tokens: int = 400, **fields: Any) -> str:
    body = {"type": "response.create", "input": "hi", "max_output_tokens": tokens, "stream_id": lane}
    return json.dumps({**body, **fields})


async def _next(ws: Any, *types: str) -> dict:
    """The next event of one of `types` (an `error` ends the wait too)."""
    async with asyncio.timeout(GUARD_S):
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] in types or ev["type"] == "error":
                return ev


async def _settled(state: GatewayState, engine: Engine) -> None:
    """Every slot given back and every engine request ended (or the guard fails the test)."""
    async with asyncio.timeout(GUARD_S):
        while state.admission.in_flight or engine.running:
            await asyncio.sleep(0.02)


def test_steer_and_close_in_one_write_leak_no_slot(tokenizer) -> None:
    engine = Engine(tokenizer)

    async def round_trip(url: str) -> None:
        async with websockets.connect(url) as ws:
            await ws.send(_create())
            created = await _next(ws, "response.created")
            await _next(ws, "response.output_text.delta")
            steer = {"type": "response.steer", "previous_response_id": created["response"]["id"], "input": "go"}
            ws.protocol.send_text(json.dumps(steer).encode())
            ws.protocol.send_close(1000)
            ws.transport.write(b"".join(ws.protocol.data_to_send()))  # both frames, one TCP write
            async with asyncio.timeout(GUARD_S):
                await ws.wait_closed()

    async def run(url: str, state: GatewayState) -> int:
        for _ in range(5):
            await round_trip(url)
        await _settled(state, engine)
        return state.admission.in_flight

    with gateway(engine) as (url, state):
        assert asyncio.run(run(url, state)) == 0


def test_frame_limit_counts_utf8_bytes_and_binary_frames_get_an_error(tokenizer) -> None:
    engine = Engine(tokenizer)

    async def run(url: str) -> list[dict]:
        async with websockets.connect(url) as ws:
            await ws.send(_create(input="é" * 600))  # ~680 characters, ~1280 bytes
            too_large = await _next(ws)
            await ws.send(b'{"type": "response.create", "input": "hi"}')
            binary = await _next(ws)
            await ws.send(_create(tokens=2))  # the socket still serves
            done = await _next(ws, "response.incomplete")
            return [too_large, binary, done]

    with gateway(engine, max_frame_bytes=1000) as (url, state):
        too_large, binary, done = asyncio.run(run(url))
        asyncio.run(_settled(state, engine))
    assert too_large["error"]["code"] == "frame_too_large" and "max_frame_bytes" in too_large["error"]["message"]
    assert binary["error"]["code"] == "binary_frame_not_supported"
    assert done["type"] == "response.incomplete"


def test_deep_json_and_huge_integers_get_error_events_and_the_socket_stays(tokenizer) -> None:
    engine = Engine(tokenizer)
    deep = "[" * 5000 + "]" * 5000
    frames = {
        "json_too_deep": ['{"type": "response.create", "tools": ' + deep + "}", deep],
        "invalid_event": [
            _create(tokens=2**64),
            _create(top_logprobs=2**64),
            '{"type": "response.create", "input": "hi", "temperature": 1e400}',
        ],
    }

    async def run(url: str) -> tuple[list[str], dict]:
        codes = []
        async with websockets.connect(url) as ws:
            for frame in [f for group in frames.values() for f in group]:
                await ws.send(frame)
                codes.append((await _next(ws))["error"]["code"])
            await ws.send(_create(tokens=2))
            return codes, await _next(ws, "response.incomplete")

    with gateway(engine) as (url, state):
        codes, done = asyncio.run(run(url))
        asyncio.run(_settled(state, engine))
    assert codes == [code for code, group in frames.items() for _ in group]
    assert done["type"] == "response.incomplete"


def test_lanes_are_bounded_and_retired_and_inputs_are_bounded(tokenizer) -> None:
    engine = Engine(tokenizer)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    async def run(url: str) -> dict[str, Any]:
        found: dict[str, Any] = {}
        async with websockets.connect(url) as ws:
            for lane in range(10):  # one after another: each lane is retired when its response ends
                await ws.send(_create(f"lane-{lane}", tokens=1))
                found.setdefault("sequential", []).append((await _next(ws, "response.incomplete"))["type"])
            for lane in "abc":  # max_lanes_per_socket=3 busy lanes
                await ws.send(_create(lane))
                created = await _next(ws, "response.created")
            await ws.send(_create("d"))
            found["fourth_lane"] = await _next(ws)
            await ws.send(_create("x" * 65))
            found["long_id"] = await _next(ws)
            await ws.send(_create("a", input=two + two[:1]))  # 3 messages > max_messages=2
            found["create_input"] = await _next(ws)
            steer = {"type": "response.steer", "previous_response_id": created["response"]["id"], "input": two * 2}
            await ws.send(json.dumps(steer))
            found["steer_input"] = await _next(ws, "response.steer.failed")
        return found

    with gateway(engine, max_lanes_per_socket=3, max_stream_id_chars=64, max_messages=2) as (url, state):
        found = asyncio.run(run(url))
        asyncio.run(_settled(state, engine))
    assert found["sequential"] == ["response.incomplete"] * 10
    assert found["fourth_lane"]["error"]["code"] == "too_many_lanes" and found["fourth_lane"]["status"] == 429
    assert "max_lanes_per_socket" in found["fourth_lane"]["error"]["message"]
    assert found["long_id"]["error"]["code"] == "stream_id_too_long"
    assert found["create_input"]["error"]["code"] == "too_many_messages"
    assert found["steer_input"]["error"]["code"] == "too_many_messages"


# Mistral-style: the template itself refuses a conversation whose roles do not alternate.
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


class StrictTokenizer:
    """The real tokenizer behind the ALTERNATING template; "boom" fails like a bug would, and
    `gate` (when set) holds every render until the test opens it."""

    def __init__(self, inner: Any, gate: threading.Event | None = None) -> None:
        self.inner, self.gate = inner, gate
        self.renders = 0
        self.gate_timed_out = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    render_chat = Tokenizer.render_chat  # through this class's apply_chat_template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None
    ) -> str:
        self.renders += 1
        if self.gate is not None and not self.gate.wait(GUARD_S):
            self.gate_timed_out = True
        if any(m["content"] == "boom" for m in messages):
            raise RuntimeError("a tokenizer bug")
        return render_chat(ALTERNATING, messages, add_generation_prompt)


def test_any_failure_ends_its_response_with_an_event_and_the_lane_serves_on(tokenizer) -> None:
    engine = Engine(tokenizer)
    engine.tokenizer = StrictTokenizer(tokenizer)
    user_user = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]

    async def run(url: str) -> list[dict]:
        events = []
        async with websockets.connect(url) as ws:
            for frame in (_create(input=user_user), _create(input="boom")):
                await ws.send(frame)
                events.append(await _next(ws))
            engine.fail_next = 1
            await ws.send(_create())
            events.append(await _next(ws, "response.failed"))
            await ws.send(_create(tokens=2))  # the same lane still serves
            events.append(await _next(ws, "response.incomplete"))
        return events

    with gateway(engine) as (url, state):
        template, bug, engine_failed, after = asyncio.run(run(url))
        asyncio.run(_settled(state, engine))
        state.admission.check_invariants()
    assert template["error"]["code"] == "invalid_input" and "alternate" in template["error"]["message"]
    assert bug["error"]["code"] == "server_error" and bug["status"] == 500 and "bug" not in bug["error"]["message"]
    assert engine_failed["response"]["status"] == "failed" and engine_failed["stream_id"] == "a"
    assert after["type"] == "response.incomplete" and after["stream_id"] == "a"


def test_a_client_that_stops_reading_is_cut_off_and_its_place_freed(tokenizer) -> None:
    # 32 KiB deltas as fast as the loop goes: the kernel's buffers fill within a few hundred.
    engine = Engine(tokenizer, pace=0, chunk="x" * 32768)

    async def run(url: str, state: GatewayState) -> tuple[int, int]:
        # A tiny receive buffer (autotuned, loopback's grows to 32 MiB), no compression (the
        # deltas would shrink to nothing), and max_queue=1: it stops reading after one message.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(url.split(":")[2].split("/")[0])))
        sock.setblocking(False)
        ws = await websockets.connect(url, sock=sock, max_queue=1, compression=None)
        try:
            await ws.send(_create(tokens=2000))  # 64 MiB, unless cut off
            await _settled(state, engine)
            async with asyncio.timeout(GUARD_S):
                while state.admission.sockets:
                    await asyncio.sleep(0.02)
            return state.admission.in_flight, engine.running
        finally:
            ws.transport.abort()

    with gateway(engine, send_timeout_s=0.5) as (url, state):
        assert asyncio.run(run(url, state)) == (0, 0)


def _post_chat(port: int) -> int:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body)
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", "Bearer k")
    try:
        with urllib.request.urlopen(request, timeout=GUARD_S) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_responses_per_client_span_http_and_websocket(tokenizer) -> None:
    """A client is its address (with its key when keys are checked): its websocket and HTTP
    responses share one quota, and another address with the same key has its own."""
    engine = Engine(tokenizer)
    auth = {"Authorization": "Bearer k"}

    async def run(url: str, port: int) -> tuple[dict, int, dict, int]:
        async with websockets.connect(url, additional_headers=auth) as a:
            for lane in "ab":  # max_responses_per_client=2
                await a.send(_create(lane))
                await _next(a, "response.created")
            await a.send(_create("c"))
            refused = await _next(a)
            http_refused = await asyncio.to_thread(_post_chat, port)
            async with websockets.connect(url, additional_headers=auth, local_addr=("127.0.0.2", 0)) as b:
                await b.send(_create("d"))
                other = await _next(b, "response.created")
        await _settled(state, engine)
        return refused, http_refused, other, await asyncio.to_thread(_post_chat, port)

    with gateway(engine, api_key="k", max_responses_per_client=2) as (url, state):
        port = int(url.split(":")[2].split("/")[0])
        refused, http_refused, other, http_after = asyncio.run(run(url, port))
        state.admission.check_invariants()
    assert refused["error"]["code"] == "too_many_client_responses" and refused["status"] == 429
    assert "max_responses_per_client" in refused["error"]["message"]
    assert http_refused == 429 and other["type"] == "response.created" and http_after == 200


def test_admission_refuses_before_the_template_which_runs_off_the_loop(tokenizer) -> None:
    engine = Engine(tokenizer)
    gate = threading.Event()
    engine.tokenizer = strict = StrictTokenizer(tokenizer, gate)

    async def run(url: str) -> tuple[dict, dict]:
        async with websockets.connect(url) as a, websockets.connect(url, local_addr=("127.0.0.2", 0)) as b:
            for ws in (a, b):  # capacity 2, one per client: both held in the template, in threads
                await ws.send(_create())
            async with websockets.connect(url, local_addr=("127.0.0.3", 0)) as c:
                await c.send(_create())
                refused = await _next(c)  # answered while both renders still wait: the loop is free
            gate.set()
            created = await _next(a, "response.created")
        return refused, created

    settings = {"max_concurrent_requests": 1, "max_queued_requests": 1, "max_responses_per_client": 1}
    with gateway(engine, **settings) as (url, state):
        try:
            refused, created = asyncio.run(run(url))
        finally:
            gate.set()
        asyncio.run(_settled(state, engine))
    assert refused["error"]["code"] == "server_overloaded" and refused["error"]["retry_after_ms"] > 0
    assert created["type"] == "response.created" and not strict.gate_timed_out
    assert strict.renders == 2  # a's and b's: the refused response never reached the template


def test_a_cancel_that_meets_a_completing_send_is_not_lost() -> None:
    """The send completes in the same loop turn as the response is cancelled (a closed socket's
    stop_all): asyncio.wait_for on Python 3.11 returned the send's result and dropped the
    cancel, and the response streamed on to its end, holding its place and KV."""
    from cadenza.gateway.send_deadline import send_within

    async def instant_send() -> None:
        return None

    async def run() -> bool:
        task = asyncio.ensure_future(send_within(instant_send(), 5.0))
        await asyncio.sleep(0)  # the send is scheduled; it completes before the task resumes
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(run()), "the cancel was swallowed"
