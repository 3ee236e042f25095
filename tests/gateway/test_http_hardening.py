"""Issue #14, the HTTP side: body limits, JSON checks, content type, Host and Origin, the API
key on every endpoint, slow and idle connections, and the drain on SIGTERM. Each over a real
uvicorn socket with engine doubles (no model, no Ray); no test asserts a duration, the
timeouts below are hang guards only."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import websockets
from cadenza_testkit.servers import CHAT, GatedEngine, free_port, serve_in_thread

from cadenza.cli.main import build_parser
from cadenza.gateway.app import build_app
from cadenza.gateway.connection_deadlines import ConnectionDeadlines, H11Deadlines, deadline_protocol
from cadenza.gateway.server import GatewayServer, settings_from_args, uvicorn_config
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model

GUARD_S = 60  # hang guard only
KEY = "hardening-key"
LIMIT = 4096
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(*read_model(DEFAULT_MODEL))


@contextlib.contextmanager
def gateway(engine: GatedEngine, check_host: bool = True, **overrides: Any) -> Iterator[int]:
    settings = GatewaySettings(port=free_port(), **overrides)
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings, check_host=check_host), settings.port):
        yield settings.port


@pytest.fixture(scope="module")
def port(tokenizer: Any) -> Iterator[int]:
    with gateway(GatedEngine(tokenizer), api_key=KEY, max_request_bytes=LIMIT, max_json_depth=8) as p:
        yield p


def _call(port: int, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any, Any]:
    """(status, body as JSON when it is JSON, headers); `body` a dict (sent as JSON) or bytes;
    `headers` with _ for -, None to leave a default header out."""
    given = {k.replace("_", "-"): v for k, v in headers.items()}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **given}
    headers = {k: v for k, v in headers.items() if v is not None}
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GUARD_S)
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        with contextlib.suppress(ValueError):
            return response.status, json.loads(raw), response.headers
        return response.status, raw.decode(), response.headers
    finally:
        conn.close()


def _error(result: tuple[int, Any, Any]) -> tuple[int, str]:
    status, body, _ = result
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return status, body["error"]["code"]


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(GUARD_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# --- bodies ---------------------------------------------------------------------------------


def test_a_content_length_over_the_limit_is_413_before_any_body_is_sent(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GUARD_S)
    conn.putrequest("POST", "/v1/chat/completions")
    for name, value in {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}.items():
        conn.putheader(name, value)
    conn.putheader("Content-Length", str(100 * LIMIT))
    conn.endheaders()  # and no body at all: the answer must not wait for it
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 413 and body["error"]["code"] == "request_too_large"
    assert "max_request_bytes" in body["error"]["message"]


def test_a_chunked_body_is_counted_while_it_arrives(port: int) -> None:
    chunks = (b"x" * 1024 for _ in range(2 * LIMIT // 1024))  # no Content-Length to trust
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GUARD_S)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", body=chunks, headers=headers, encode_chunked=True)
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 413 and body["error"]["code"] == "request_too_large"
    assert _call(port, "POST", "/v1/chat/completions", CHAT)[0] == 200  # still serving


def test_deep_json_is_400_before_the_parser_sees_it(port: int) -> None:
    nine_deep = {"messages": [{"role": "user", "content": "hi"}], "stop": [[[[[[[["x"]]]]]]]]}
    assert _error(_call(port, "POST", "/v1/chat/completions", nine_deep)) == (400, "invalid_request_body")
    deep = b"[" * 2000 + b"]" * 2000  # msgspec alone would hit RecursionError on far less
    assert _error(_call(port, "POST", "/v1/completions", deep)) == (400, "invalid_request_body")
    brackets_in_text = {"messages": [{"role": "user", "content": "[" * 100}], "max_tokens": 2}
    assert _call(port, "POST", "/v1/chat/completions", brackets_in_text)[0] == 200


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}'),
        ("/v1/completions", b'{"prompt": [18446744073709551616]}'),
        ("/v1/completions", b'{"prompt": [-9223372036854775809]}'),
        ("/v1/completions", b'{"prompt": [' + b"9" * 3000 + b"]}"),  # past int()'s own digit limit
    ],
)
def test_integers_past_64_bits_are_400_not_500(port: int, path: str, raw: bytes) -> None:
    status, code = _error(_call(port, "POST", path, raw))
    assert (status, code) == (400, "invalid_request_body")


def test_long_numbers_that_fit_pass_the_integer_check(port: int) -> None:
    fits = b'{"messages": [{"role": "user", "content": "12345678901234567890123"}], "max_tokens": 2, '
    fits += b'"temperature": 1.00000000000000000000000001, "seed": 18446744073709551615}'
    assert _call(port, "POST", "/v1/chat/completions", fits)[0] == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_endpoints_need_a_json_content_type(port: int, content_type: str | None) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        result = _call(port, "POST", path, CHAT, Content_Type=content_type)
        assert _error(result) == (415, "unsupported_media_type")


def test_json_content_type_parameters_are_fine(port: int) -> None:
    assert _call(port, "POST", "/v1/chat/completions", CHAT, Content_Type="application/json; charset=utf-8")[0] == 200


# --- Host and Origin ------------------------------------------------------------------------


def test_a_foreign_host_is_refused_naming_the_flag(port: int) -> None:
    for path in ("/", "/health", "/v1/models"):
        status, body, _ = _call(port, "GET", path, Host=f"rebound.example:{port}")
        assert status == 421 and body["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts rebound.example" in body["error"]["message"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert _call(port, "GET", "/health", Host=host)[0] == 200, host


def test_a_foreign_host_is_refused_on_the_websocket(port: int) -> None:
    async def handshake(host: str) -> tuple[dict, int | None]:
        uri = f"ws://{host}/v1/responses"
        auth = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(uri, host="127.0.0.1", port=port, additional_headers=auth) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), GUARD_S))
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), GUARD_S)
            return first, ws.close_code

    refused, code = asyncio.run(handshake(f"rebound.example:{port}"))
    assert refused["type"] == "error" and refused["error"]["code"] == "host_not_allowed" and code == 1008

    async def own() -> str:
        auth = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(f"ws://localhost:{port}/v1/responses", additional_headers=auth) as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 2}))
            while (ev := json.loads(await asyncio.wait_for(ws.recv(), GUARD_S)))["type"] == "response.created":
                pass
            return ev["type"]

    assert asyncio.run(own()) != "error"


def test_a_foreign_origin_is_refused_on_http(port: int) -> None:
    result = _call(port, "POST", "/v1/chat/completions", CHAT, Origin="https://evil.example")
    assert _error(result) == (403, "origin_not_allowed")
    assert _error(_call(port, "GET", "/stats", Origin="null")) == (403, "origin_not_allowed")
    assert _call(port, "POST", "/v1/chat/completions", CHAT, Origin=f"http://127.0.0.1:{port}")[0] == 200


def test_under_serve_the_host_check_is_off_unless_hosts_are_named(tokenizer: Any) -> None:
    with gateway(GatedEngine(tokenizer), check_host=False) as p:
        assert _call(p, "GET", "/health", Host="cadenza.cluster.internal")[0] == 200


def test_allowed_hosts_flag_takes_whole_names() -> None:
    args = build_parser().parse_args(["serve", "--allowed-hosts", "api.example", "api.example:8443"])
    assert settings_from_args(args).allowed_hosts == ("api.example", "api.example:8443")


# --- the API key ----------------------------------------------------------------------------


def test_the_api_key_guards_everything_but_health_and_the_page(port: int) -> None:
    for method, path, body in [
        ("GET", "/stats", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ]:
        for auth in (None, "Bearer wrong", KEY):  # the last: a key without "Bearer "
            assert _error(_call(port, method, path, body, Authorization=auth)) == (401, "invalid_api_key"), path
        status = _call(port, method, path, body)[0]
        assert status == 200 or (path == "/metrics" and status != 401), path  # the double has no engine stats
    assert _call(port, "GET", "/health", Authorization=None)[0] == 200


def test_the_chat_page_is_public_but_names_no_model_and_leaks_no_referer(port: int) -> None:
    status, page, headers = _call(port, "GET", "/", Authorization=None)
    assert status == 200 and "sessionStorage" in page and "history.replaceState" in page
    assert DEFAULT_MODEL not in page
    assert headers["Referrer-Policy"] == "no-referrer" and headers["X-Frame-Options"] == "DENY"


def test_the_chat_page_takes_the_key_once_and_keeps_it_out_of_the_address(port: int) -> None:
    from cadenza_testkit.browser import CHROMIUM_ARGS, chromium_path
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        page = browser.new_page()
        for address in (f"/?lang=en#api_key={KEY}", f"/?api_key={KEY}&lang=en"):
            page.goto(f"http://127.0.0.1:{port}{address}")
            expect(page.locator("#status")).to_have_text("connected", timeout=GUARD_S * 1000)
            assert page.url == f"http://127.0.0.1:{port}/?lang=en"  # the key is out of the address
            assert page.evaluate("sessionStorage.getItem('cadenza_api_key')") == KEY
        page.reload()  # the tab keeps the key, and the socket it opens with it is served
        expect(page.locator("#status")).to_have_text("connected", timeout=GUARD_S * 1000)
        page.fill("#input", "hi")
        page.keyboard.press("Enter")
        expect(page.locator(".msg.assistant").first).to_contain_text("aaa", timeout=GUARD_S * 1000)
        browser.close()


def test_an_empty_api_key_is_refused_at_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cadenza.cli.main", "serve", "--api-key", "", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=GUARD_S * 3,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert "api_key must not be empty" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(ValueError, match="api_key must not be empty"):
        settings_from_args(build_parser().parse_args(["serve", "--api-key", "  "]))


# --- slow and idle connections --------------------------------------------------------------


def test_a_trickling_request_head_is_closed_and_a_long_response_is_not(tokenizer: Any) -> None:
    with gateway(GatedEngine(tokenizer), header_timeout_s=0.3, idle_timeout_s=GUARD_S) as p:
        with socket.create_connection(("127.0.0.1", p)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
            assert _read_until_closed(sock) == b""
        with socket.create_connection(("127.0.0.1", p)) as sock:  # says nothing at all
            assert _read_until_closed(sock) == b""
        # A stream running far past header_timeout_s, and a second request on the same connection.
        conn = http.client.HTTPConnection("127.0.0.1", p, timeout=GUARD_S)
        stream = {**CHAT, "max_tokens": 60, "stream": True}
        for _ in range(2):
            conn.request("POST", "/v1/chat/completions", json.dumps(stream), {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200 and response.read().endswith(b"data: [DONE]\n\n")
        conn.close()

        async def websocket() -> str:  # an upgraded connection is not a head in waiting either
            async with websockets.connect(f"ws://127.0.0.1:{p}/v1/responses") as ws:
                await ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 60}))
                while not (ev := json.loads(await asyncio.wait_for(ws.recv(), GUARD_S)))["type"].startswith(
                    ("response.completed", "response.incomplete", "response.failed", "error")
                ):
                    pass
                return ev["type"]

        assert asyncio.run(websocket()) == "response.incomplete"  # max_output_tokens reached


@pytest.mark.parametrize("base", [H11Deadlines, deadline_protocol(0.0, 30.0)], ids=["h11", "default"])
def test_both_uvicorn_protocols_close_a_trickling_head(base: type) -> None:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    p = free_port()
    protocol = type("Protocol", (base,), {"head_timeout_s": 0.3})
    server = uvicorn.Server(uvicorn.Config(app, port=p, http=protocol, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with socket.create_connection(("127.0.0.1", p)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _read_until_closed(sock).startswith(b"HTTP/1.1 200")  # a whole head is served
        with socket.create_connection(("127.0.0.1", p)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            assert _read_until_closed(sock) == b""
    finally:
        server.should_exit = True
        thread.join(GUARD_S)


class _Timers:
    """A loop's call_later, fired by hand."""

    def __init__(self) -> None:
        self.due: list[tuple[Any, tuple]] = []

    def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
        self.due.append((fn, args))
        return types.SimpleNamespace(cancel=lambda: None)

    def fire(self) -> bool:
        if not self.due:
            return False
        fn, args = self.due.pop(0)
        fn(*args)
        return True


class _DrainProbe(ConnectionDeadlines):
    """The drain watch over a transport whose unsent bytes follow `unsent`, one value a check."""

    def __init__(self, unsent: list[int]) -> None:
        self.loop, self.resets, self.unsent = _Timers(), 0, unsent
        self.transport = types.SimpleNamespace(get_write_buffer_size=lambda: self.unsent.pop(0))

    def reset_connection(self) -> None:
        self.resets += 1


@pytest.mark.parametrize(
    ("unsent", "resets"),
    [([0], 0), ([900, 500, 100, 0], 0), ([900, 900], 1), ([900, 500, 500], 1), ([900, 400, 700], 1)],
    ids=["all-sent", "slow-reader", "stalled", "stalled-later", "grew"],
)
def test_a_finished_answer_is_reset_only_when_its_client_takes_nothing(unsent: list[int], resets: int) -> None:
    """After a response is complete, its unsent bytes are checked every send_timeout_s: a
    client that takes some of them keeps its connection, one that takes none is reset."""
    probe = _DrainProbe(list(unsent))
    probe.watch_drain(None)
    while probe.loop.fire():
        pass
    assert probe.resets == resets and not probe.unsent


def test_an_idle_keep_alive_connection_is_closed(tokenizer: Any) -> None:
    with gateway(GatedEngine(tokenizer), idle_timeout_s=0.3, header_timeout_s=GUARD_S) as p:
        with socket.create_connection(("127.0.0.1", p)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # keep-alive: HTTP/1.1's default
            answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')


# --- the drain ------------------------------------------------------------------------------


@contextlib.contextmanager
def draining_gateway(engine: GatedEngine, **overrides: Any) -> Iterator[tuple[int, GatewayServer]]:
    """The gateway on GatewayServer (as `cadenza serve` runs it) in a thread; setting
    should_exit does what SIGTERM does there."""
    settings = GatewaySettings(port=free_port(), **overrides)
    app = build_app(engine, DEFAULT_MODEL, settings)
    server = GatewayServer(uvicorn_config(app, settings), app.state.gateway)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + GUARD_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield settings.port, server
    finally:
        server.should_exit = True
        thread.join(GUARD_S)
    assert not thread.is_alive(), "the server did not stop after its drain"


async def _sse(port: int, body: dict, started: asyncio.Event) -> list[str]:
    """Every `data:` payload of one streamed request; `started` is set at the first one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps({**body, "stream": True})
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(raw)}\r\n\r\n{raw}".encode()
    )
    payloads = []
    while line := await reader.readline():
        if line.startswith(b"data: "):
            payloads.append(line.removeprefix(b"data: ").decode().strip())
            started.set()
    writer.close()
    return payloads


async def _ws_events(port: int, events: list[dict], late: asyncio.Event, refused: asyncio.Event) -> None:
    """One response on lane "a"; once `late` is set, one more on lane "b" (`refused` is set at
    the first `error` event). Every event lands in `events`, until the server closes."""
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/responses") as ws:
        await ws.send(json.dumps({"type": "response.create", "input": "hi", "stream_id": "a"}))

        async def create_late() -> None:
            await late.wait()
            await ws.send(json.dumps({"type": "response.create", "input": "more", "stream_id": "b"}))

        sender = asyncio.create_task(create_late())
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in ws:
                events.append(json.loads(message))
                if events[-1]["type"] == "error":
                    refused.set()
        sender.cancel()


async def _drain_start(server: GatewayServer, engine: GatedEngine, running: int) -> None:
    """Once `running` responses are in the engine, what uvicorn's SIGTERM handler does."""
    async with asyncio.timeout(GUARD_S):
        while engine.running < running:
            await asyncio.sleep(0.01)
        server.should_exit = True
        while not server.state.drain.draining:
            await asyncio.sleep(0.01)


def test_drain_refuses_new_work_and_lets_running_responses_finish(tokenizer: Any) -> None:
    engine = GatedEngine(tokenizer, gated=True)
    with draining_gateway(engine, drain_timeout_s=GUARD_S) as (port, server):

        async def run() -> tuple[list[str], list[dict], tuple, dict]:
            late, refused, events = asyncio.Event(), asyncio.Event(), []
            sse = asyncio.create_task(_sse(port, CHAT, asyncio.Event()))
            ws = asyncio.create_task(_ws_events(port, events, late, refused))
            await _drain_start(server, engine, running=2)
            refused_http = await asyncio.to_thread(_call, port, "GET", "/health")
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/responses") as newcomer:
                refused_ws = json.loads(await asyncio.wait_for(newcomer.recv(), GUARD_S))
            late.set()
            async with asyncio.timeout(GUARD_S):
                await refused.wait()
                engine.gate.set()  # the running responses may now finish
                await ws
                return await sse, events, refused_http, refused_ws

        payloads, events, refused_http, refused_ws = asyncio.run(run())
    assert _error(refused_http) == (503, "server_shutting_down")
    assert refused_ws["error"]["code"] == "server_shutting_down"
    assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["choices"][0]["finish_reason"] == "stop"
    types = [e["type"] for e in events]
    assert "response.completed" in types  # lane a finished
    (late,) = [e for e in events if e["type"] == "error"]  # lane b came after the drain began
    assert late["stream_id"] == "b" and late["error"]["code"] == "server_overloaded"


def test_drain_timeout_ends_each_stream_with_its_terminal_event(tokenizer: Any) -> None:
    engine = GatedEngine(tokenizer, gated=True)  # never opened: nothing finishes by itself
    with draining_gateway(engine, drain_timeout_s=0.2) as (port, server):

        async def run() -> tuple[list[str], list[dict], tuple]:
            events: list[dict] = []
            sse = asyncio.create_task(_sse(port, CHAT, asyncio.Event()))
            ws = asyncio.create_task(_ws_events(port, events, asyncio.Event(), asyncio.Event()))
            whole = asyncio.create_task(asyncio.to_thread(_call, port, "POST", "/v1/chat/completions", CHAT))
            await _drain_start(server, engine, running=3)
            async with asyncio.timeout(GUARD_S):
                await ws
                return await sse, events, await whole

        payloads, events, whole = asyncio.run(run())
    assert payloads[-1] == "[DONE]" and "shut down" in json.loads(payloads[-2])["error"]["message"]
    failed = [e for e in events if e["type"] == "response.failed"]
    assert failed and "shut down" in failed[0]["response"]["error"]["message"]
    status, body, _ = whole
    assert status >= 500 and "shut down" in body["error"]["message"]
    assert engine.running == 0  # every engine stream was closed (its request aborted)


@pytest.mark.heavy  # a server process of its own, signalled
def test_sigterm_drains_and_exits_0(tokenizer: Any) -> None:
    port = free_port()
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from cadenza_testkit.servers import PacedEngine;"
        "from cadenza.gateway.app import build_app;"
        "from cadenza.gateway.server import serve;"
        "from cadenza.gateway.settings import GatewaySettings;"
        "settings = GatewaySettings(port=int(sys.argv[2]), drain_timeout_s=0.3);"
        "serve(build_app(PacedEngine(pace=0.02), 'm', settings), settings)"
    )
    here = str(REPO / "tests" / "support")  # where cadenza_testkit lives
    process = subprocess.Popen([sys.executable, "-c", script, here, str(port)], cwd=REPO, env=os.environ.copy())
    try:
        deadline = time.monotonic() + GUARD_S * 3
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(OSError):
                if _call(port, "GET", "/health")[0] == 200:
                    break
            time.sleep(0.2)

        async def run() -> list[str]:
            started = asyncio.Event()
            sse = asyncio.create_task(_sse(port, {**CHAT, "max_tokens": 2000}, started))
            async with asyncio.timeout(GUARD_S):
                await started.wait()
                process.send_signal(signal.SIGTERM)
                return await sse

        payloads = asyncio.run(run())
        assert process.wait(GUARD_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert payloads[-1] == "[DONE]" and "shut down" in json.loads(payloads[-2])["error"]["message"]


def test_a_stream_cancelled_before_its_first_chunk_gives_its_place_back() -> None:
    """The client left before the response started: the SSE generator never runs (so its own
    `finally` never does), yet the admission place is released."""
    from cadenza.gateway.send_deadline import SseStream

    released, started = [], []

    async def chunks():  # noqa: ANN202
        started.append(True)
        yield "data: x\n\n"

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise OSError("the client is gone")

    async def run() -> None:
        response = SseStream(chunks(), GUARD_S, lambda: released.append(True))
        with contextlib.suppress(Exception):  # starlette reports it as ClientDisconnect
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(run())
    assert released == [True] and not started
