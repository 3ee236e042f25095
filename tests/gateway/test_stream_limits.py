"""Issue #38, HTTP event streams: a client that stops reading is cut off after send_timeout_s
(its engine request aborted, its places given back, its connection dropped), and each client
may hold at most max_streams_per_client streams. Over a real uvicorn socket in this process
(so the admission counters can be read) with an engine double; no test asserts a duration,
the timeouts below are hang guards only."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cadenza_testkit.servers import GatedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.state import GatewayState
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model

GUARD_S = 60  # hang guard only: every wait below ends on an event or a condition
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}
# 32 KiB deltas as fast as the loop goes: a client's kernel buffers fill within a few hundred.
FLOOD = "x" * 32768


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(*read_model(DEFAULT_MODEL))


@contextlib.contextmanager
def served(engine: GatedEngine, **overrides: Any) -> Iterator[tuple[int, GatewayState]]:
    settings = GatewaySettings(port=free_port(), **overrides)
    app = build_app(engine, DEFAULT_MODEL, settings)
    try:
        with serve_in_thread(app, settings.port):
            yield settings.port, app.state.gateway
    finally:
        engine.gate.set()  # nothing streams on after the test


def _request(method: str, path: str, body: dict | None = None) -> bytes:
    raw = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
    return f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw


def _call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
    """(status, JSON body) of one request read whole."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GUARD_S)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _background(port: int) -> str:
    """The id of a background response (it runs until the engine's gate opens)."""
    status, created = _call(port, "POST", "/v1/responses", {"input": "hi", "background": True})
    assert status == 200, created
    return created["id"]


def _stalled(port: int, request: bytes) -> socket.socket:
    """A client that sends `request` and never reads. Its receive buffer is set before it
    connects, so the kernel does not grow it (on loopback it would reach 32 MiB)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def _dropped(sock: socket.socket) -> bool:
    """Whether the server drops the connection (a reset or its close), seen without reading a
    byte of what is still waiting in the socket."""
    poller = select.poll()
    poller.register(sock, 0)  # POLLHUP and POLLERR are always reported
    return bool(poller.poll(GUARD_S * 1000))


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


STALLED_STREAMS = {
    "chat": lambda port: _request("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    "responses": lambda port: _request("POST", "/v1/responses", {"input": "hi", "stream": True}),
    "follower": lambda port: _request("GET", f"/v1/responses/{_background(port)}?stream=true"),
}


@pytest.mark.heavy  # waits out a send deadline per stream kind
@pytest.mark.parametrize("kind", sorted(STALLED_STREAMS))
def test_a_stream_that_is_not_read_is_cut_and_gives_everything_back(tokenizer: Any, kind: str) -> None:
    """A client that stops reading a stream (a chat stream, a streamed response, a follower of
    a background response): once a send waits past send_timeout_s its connection is dropped,
    its engine request aborted (the follower's background response runs on) and its places
    given back."""
    engine = GatedEngine(tokenizer, pace=0.0, gated=True, chunk=FLOOD)
    with served(engine, send_timeout_s=0.5) as (port, state):
        sock = _stalled(port, STALLED_STREAMS[kind](port))
        try:
            assert _dropped(sock), "the server still holds the connection of a client that stopped reading"
            _wait_until(lambda: not state.admission.streams, "the stream was not given back")
            if kind == "follower":  # its background response was never the follower's to end
                assert engine.running == 1 and state.admission.in_flight == 1
                engine.gate.set()
            _wait_until(lambda: engine.running == 0, "the engine request was not aborted")
            _wait_until(lambda: state.admission.in_flight == 0, "the admission place was not given back")
            state.admission.check_invariants()
        finally:
            sock.close()


@pytest.mark.heavy  # waits out a send deadline
def test_a_whole_answer_that_is_not_read_drops_its_connection(tokenizer: Any) -> None:
    """A non-streamed answer far larger than the socket buffers (400 x 32 KiB), to a client
    that never reads it: once its send waits past send_timeout_s the connection is dropped
    (uvicorn alone would hold it, and its place, for as long as the client lives)."""
    engine = GatedEngine(tokenizer, pace=0.0, chunk=FLOOD)
    with served(engine, send_timeout_s=0.5) as (port, state):
        sock = _stalled(port, _request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 400}))
        try:
            assert _dropped(sock), "the server still holds the connection of a client that does not read"
            _wait_until(lambda: engine.running == 0 and state.admission.in_flight == 0, "not given back")
            assert _call(port, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1})[0] == 200
        finally:
            sock.close()


def _stalled_websocket(port: int) -> socket.socket:
    """A websocket client that sends one response.create (a text frame, masked with a zero
    mask) once its handshake is answered, and then never reads."""
    sock = _stalled(
        port,
        b"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    sock.settimeout(GUARD_S)
    head = b""
    while not head.endswith(b"\r\n\r\n"):  # byte by byte: nothing past the head is read
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    text = json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 1000}).encode()
    assert len(text) < 126  # the one-byte length form
    sock.sendall(bytes([0x81, 0x80 | len(text)]) + b"\0\0\0\0" + text)
    return sock


@pytest.mark.heavy  # waits out a send deadline
def test_a_websocket_that_is_not_read_drops_its_connection(tokenizer: Any) -> None:
    """A websocket client that stops reading: its responses end, its socket place is given back
    and its TCP connection is dropped (before, uvicorn kept a connection whose unsent frames
    never drained)."""
    engine = GatedEngine(tokenizer, pace=0.0, gated=True, chunk=FLOOD)
    with served(engine, send_timeout_s=0.5) as (port, state):
        sock = _stalled_websocket(port)
        try:
            assert _dropped(sock), "the server still holds the connection of a websocket that stopped reading"
            _wait_until(lambda: engine.running == 0, "the engine request was not aborted")
            _wait_until(lambda: not state.admission.sockets and not state.admission.in_flight, "not given back")
            state.admission.check_invariants()
        finally:
            sock.close()


async def _read_stream(port: int, request: bytes, started: asyncio.Event) -> list[bytes]:
    """Every line of one streamed response, read to its end; `started` is set at its head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    status = await reader.readline()
    assert b" 200 " in status, status
    started.set()
    lines = []
    while line := await reader.readline():  # Connection: close: the response ends with it
        lines.append(line)
    writer.close()
    return lines


def test_streams_per_client_are_capped_and_given_back(tokenizer: Any) -> None:
    engine = GatedEngine(tokenizer, pace=0.01, gated=True)

    async def run(port: int, state: GatewayState) -> list[tuple[int, Any]]:
        held = [asyncio.Event(), asyncio.Event()]
        chat = _request("POST", "/v1/chat/completions", {**CHAT, "stream": True})
        follow = _request("GET", f"/v1/responses/{await asyncio.to_thread(_background, port)}?stream=true")
        streams = [asyncio.create_task(_read_stream(port, r, e)) for r, e in zip((chat, follow), held)]
        async with asyncio.timeout(GUARD_S):
            for event in held:
                await event.wait()
            refused = [
                await asyncio.to_thread(_call, port, "POST", "/v1/chat/completions", {**CHAT, "stream": True}),
                await asyncio.to_thread(_call, port, "POST", "/v1/responses", {"input": "hi", "stream": True}),
                await asyncio.to_thread(_call, port, "GET", follow.split(b" ")[1].decode()),
            ]
            assert list(state.admission.streams.values()) == [2] and engine.running == 2
            engine.gate.set()  # every stream ends; their places and streams are given back
            await asyncio.gather(*streams)
        return refused

    with served(engine, max_streams_per_client=2) as (port, state):
        refused = asyncio.run(run(port, state))
        _wait_until(lambda: not state.admission.streams and not state.admission.in_flight, "not given back")
        assert _call(port, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1})[0] == 200
    for status, body in refused:
        assert status == 429 and body["error"]["code"] == "too_many_client_streams", body
        assert "2 streams open (max_streams_per_client)" in body["error"]["message"]
