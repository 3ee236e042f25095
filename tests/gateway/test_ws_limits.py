"""Admission limits of the gateway, over a real uvicorn socket, with a paced engine: the
limits are about counting, so the engine here only has to hold responses open on cue."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import websockets
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread
from cadenza_testkit.waiting import until

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL


@pytest.fixture(scope="module")
def paced() -> Iterator[tuple[str, PacedEngine, int]]:
    engine = PacedEngine(pace=0.05)
    settings = GatewaySettings(
        port=free_port(),
        max_concurrent_requests=4,
        max_queued_requests=2,
        max_responses_per_socket=3,
        max_sockets_per_client=5,
    )
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), settings.port):
        yield f"ws://127.0.0.1:{settings.port}/v1/responses", engine, settings.port


def _create(lane: str, tokens: int = 40) -> str:
    return json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": tokens, "stream_id": lane})


async def _errors(ws, wanted: int, timeout: float = 10) -> list[dict]:  # noqa: ANN001
    found = []
    async with asyncio.timeout(timeout):
        while len(found) < wanted:
            ev = json.loads(await ws.recv())
            if ev["type"] == "error":
                found.append(ev)
    return found


async def _drained(engine: PacedEngine) -> None:
    """Responses of earlier tests end when their sockets close; wait for that."""
    async with asyncio.timeout(5):
        while engine.running:
            await asyncio.sleep(0.02)


def test_per_socket_cap_refuses_the_extra_response(paced) -> None:
    url, _, _ = paced

    async def run() -> list[dict]:
        async with websockets.connect(url) as ws:
            for lane in "abcd":  # the 4th exceeds max_responses_per_socket=3
                await ws.send(_create(lane))
            return await _errors(ws, 1)

    (error,) = asyncio.run(run())
    assert error["error"]["code"] == "too_many_responses" and error["stream_id"] == "d"
    assert error["status"] == 429


def test_server_capacity_refuses_before_work_with_a_retry_hint(paced) -> None:
    url, engine, _ = paced

    async def run() -> tuple[list[dict], int]:
        await _drained(engine)
        # b connects from another loopback address: one client may not fill the server alone.
        other = websockets.connect(url, local_addr=("127.0.0.2", 0))
        async with websockets.connect(url) as a, other as b, websockets.connect(url) as c:
            for ws, lanes in ((a, "abc"), (b, "def")):  # 6 = max_concurrent 4 + max_queued 2
                for lane in lanes:
                    await ws.send(_create(lane))
            await until(lambda: engine.running == 6, "all six admitted and streaming")
            await c.send(_create("g"))
            errors = await _errors(c, 1)
            return errors, engine.running

    errors, running = asyncio.run(run())
    assert errors[0]["error"]["code"] == "server_overloaded"
    assert errors[0]["error"]["retry_after_ms"] > 0 and errors[0]["status"] == 429
    assert running == 6  # the refused one never reached the engine


def test_sockets_per_client_cap(paced) -> None:
    url, _, _ = paced

    async def run() -> dict:
        sockets = [await websockets.connect(url) for _ in range(5)]
        try:
            async with websockets.connect(url) as extra:
                return json.loads(await extra.recv())
        finally:
            for ws in sockets:
                await ws.close()

    refused = asyncio.run(run())
    assert refused["error"]["code"] == "too_many_sockets"


def test_cancel_stops_a_running_response(paced) -> None:
    url, engine, _ = paced

    async def run() -> dict:
        async with websockets.connect(url) as ws:
            await ws.send(_create("a", tokens=400))
            while True:
                ev = json.loads(await ws.recv())
                if ev["type"] == "response.created":
                    response_id = ev["response"]["id"]
                if ev["type"] == "response.output_text.delta":
                    await ws.send(json.dumps({"type": "response.cancel", "response_id": response_id}))
                if ev["type"].startswith("response.incomplete"):
                    return ev

    final = asyncio.run(run())
    assert final["response"]["status"] == "cancelled"
    assert final["response"]["usage"]["output_tokens"] < 400


def test_health_is_503_with_the_reason_when_the_engine_cannot_serve(paced) -> None:
    _, engine, port = paced
    url = f"http://127.0.0.1:{port}/health"
    with urllib.request.urlopen(url) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    engine.problem = "the engine actor died"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url)
        assert refused.value.code == 503
        assert json.loads(refused.value.read())["error"] == "the engine actor died"
    finally:
        engine.problem = None


def _post_chat(port: int, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode(),
        headers={"Content-Type": "application/json"},
    )


def test_http_over_capacity_is_429_with_retry_after_and_disconnect_aborts(paced) -> None:
    url, engine, port = paced

    async def run() -> tuple[int, str | None, int]:
        await _drained(engine)
        other = websockets.connect(url, local_addr=("127.0.0.2", 0))  # two clients fill it
        async with websockets.connect(url) as a, other as b:
            for ws, lanes in ((a, "abc"), (b, "def")):  # fill max_concurrent 4 + max_queued 2
                for lane in lanes:
                    await ws.send(_create(lane, tokens=400))
            await until(lambda: engine.running == 6, "all six admitted and streaming")
            try:
                await asyncio.to_thread(urllib.request.urlopen, _post_chat(port, {"max_tokens": 4}))
            except urllib.error.HTTPError as e:
                status, retry, body = e.code, e.headers.get("Retry-After"), json.loads(e.read())
            assert body["error"]["code"] == "server_overloaded"
            return status, retry, engine.running

    status, retry, running = asyncio.run(run())
    assert status == 429 and retry is not None and int(retry) >= 1 and running == 6

    async def disconnect_mid_stream() -> None:
        await _drained(engine)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True})
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        await writer.drain()
        while b"data: {" not in await reader.read(4096):
            pass
        # The first chunk (the role) may leave before the engine stream is entered.
        await until(lambda: engine.running == 1, "the stream running in the engine")
        writer.close()  # gone mid-stream
        await _drained(engine)  # the engine request was aborted, not run to 400 tokens

    asyncio.run(disconnect_mid_stream())
