"""Protocol fuzzing of the HTTP and websocket schemas (hypothesis): generated bodies and
frames, from valid requests with fields replaced by arbitrary JSON (huge and negative
integers, deep nesting, wrong types, unknown keys, broken UTF-8), are answered 2xx or 4xx
and never 5xx; a websocket is never dropped without a close frame; and after each one the
server still serves a normal request.

The gateway runs in this process on uvicorn over an engine double that has the real
tokenizer and request limits (the checks are the engine's own functions), so every example
exercises the real parsing and validation without paying for a forward pass."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import websockets
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings

MODEL = "SmolLM2-135M-Instruct"
EXAMPLES = 150


class LimitedEngine(PacedEngine):
    """PacedEngine with the model's request limits (every PacedEngine has them now), so the
    gateway runs the engine's checks."""

    def __init__(self) -> None:
        super().__init__(pace=0.0005)


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    port = free_port()
    settings_ = GatewaySettings(port=port, max_frame_bytes=1 << 16, max_request_bytes=1 << 16)
    app = build_app(LimitedEngine(), MODEL, settings_)
    with serve_in_thread(app, port):
        yield f"127.0.0.1:{port}"


# Leaves of every kind a client could send, ints past 64 bits included.
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
_containers = lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
_json = st.recursive(_leaves, _containers, max_leaves=12)
_deep = st.integers(min_value=30, max_value=5000).map(lambda n: "[" * n + "]" * n)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"type": "response.create", "model": MODEL, "input": "hi", "max_output_tokens": 2}
CHAT_FIELDS = [
    "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
    "stream", "logprobs", "top_logprobs", "presence_penalty", "min_p", "min_tokens", "model", "cache_salt",
]  # fmt: skip
COMPLETION_FIELDS = ["prompt", "max_tokens", "logprobs", "seed", "top_k", "stop", "n", "stream", "echo"]
RESPONSE_FIELDS = ["input", "max_output_tokens", "temperature", "top_p", "top_logprobs", "stream_id", "type"]


def _mutated(base: dict, fields: list[str]) -> st.SearchStrategy[bytes]:
    """The base body with some fields replaced by arbitrary JSON, or one field nested
    thousands deep, serialised (huge ints survive json.dumps); sometimes raw garbage or a
    bare deep array."""
    replaced = st.dictionaries(st.sampled_from(fields), _json, min_size=1, max_size=3)
    bodies = replaced.map(lambda r: json.dumps({**base, **r}).encode())
    deep_field = st.tuples(st.sampled_from(fields), st.integers(min_value=30, max_value=5000)).map(
        lambda fd: json.dumps({**base, fd[0]: "@DEEP@"}).replace('"@DEEP@"', "[" * fd[1] + "]" * fd[1]).encode()
    )
    garbage = st.binary(max_size=64) | _deep.map(str.encode)
    return bodies | deep_field | garbage


def _post(host: str, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{host}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:  # a hang guard
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _assert_alive(host: str) -> None:
    status, body = _post(host, "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"]


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ_SETTINGS
@given(body=_mutated(CHAT, CHAT_FIELDS))
def test_chat_bodies_get_2xx_or_4xx(gateway: str, body: bytes) -> None:
    _check_http(gateway, "/v1/chat/completions", body)


@FUZZ_SETTINGS
@given(body=_mutated(COMPLETION, COMPLETION_FIELDS))
def test_completion_bodies_get_2xx_or_4xx(gateway: str, body: bytes) -> None:
    _check_http(gateway, "/v1/completions", body)


def _check_http(host: str, path: str, body: bytes) -> None:
    status, answer = _post(host, path, body)
    assert status < 500, (status, answer[:300], body[:200])
    if status >= 400:
        assert json.loads(answer)["error"]["message"]  # a clear error, in OpenAI's shape
    _assert_alive(host)


@FUZZ_SETTINGS
@given(frame=_mutated(RESPONSE, RESPONSE_FIELDS), binary=st.booleans())
def test_websocket_frames_get_events_and_never_a_dropped_socket(gateway: str, frame: bytes, binary: bool) -> None:
    asyncio.run(_check_frame(gateway, frame, binary))


async def _check_frame(host: str, frame: bytes, binary: bool) -> None:
    async with websockets.connect(f"ws://{host}/v1/responses") as conn:
        try:
            text = frame.decode()
        except UnicodeDecodeError:
            binary = True
        await conn.send(frame if binary else text)
        await _drain_until_terminal(conn)
        # The same socket still serves a normal response.
        await conn.send(json.dumps(RESPONSE))
        events = await _drain_until_terminal(conn)
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]


async def _drain_until_terminal(conn: websockets.ClientConnection) -> list[dict]:
    """Events up to one `error` or terminal event; a close without a close frame fails here."""
    events = []
    while True:
        try:
            raw = await asyncio.wait_for(conn.recv(), timeout=60)  # a hang guard
        except websockets.ConnectionClosed as e:
            assert e.rcvd is not None, "the socket was dropped without a close frame"
            raise AssertionError(f"the server closed the socket ({e.rcvd.code}) on a single bad frame") from e
        event = json.loads(raw)
        events.append(event)
        if event["type"] == "error":
            assert event["status"] < 500, event
            return events
        if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
            assert event["type"] != "response.failed", event
            return events
