"""Issue #38: a client's identity (the unit of every per-client quota) cannot be forged.
Forwarded headers count only from --forwarded-allow-ips; a presented key, junk or real, never
names a client. Over a real uvicorn socket with an engine double; no test asserts a duration."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
import websockets
from cadenza_testkit.servers import CHAT, GatedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model
from cadenza.request_limits import KEY_SUBPROTOCOL

KEY = "identity-key"
QUOTA = 2


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(*read_model(DEFAULT_MODEL))


def _serve(engine: GatedEngine, **overrides: Any) -> Any:
    settings = GatewaySettings(port=free_port(), api_key=KEY, max_responses_per_client=QUOTA, **overrides)
    return serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), settings.port), settings.port


def _open_stream(port: int, forwarded_for: str) -> tuple[http.client.HTTPConnection, int]:
    """Starts a streamed chat (the engine holds it open) and returns once its status is in."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "X-Forwarded-For": forwarded_for}
    conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True}), headers)
    response = conn.getresponse()
    if response.status != 200:
        response.read()
    return conn, response.status


def _statuses(tokenizer: Any, **overrides: Any) -> list[int]:
    """The statuses of QUOTA + 1 concurrent streams, each claiming another X-Forwarded-For."""
    engine = GatedEngine(tokenizer, gated=True)
    server, port = _serve(engine, **overrides)
    with server:
        opened = [_open_stream(port, f"203.0.113.{i}") for i in range(QUOTA + 1)]
        engine.gate.set()
        for conn, _ in opened:
            conn.close()
    return [status for _, status in opened]


def test_forwarded_for_from_loopback_does_not_make_new_clients(tokenizer: Any) -> None:
    assert _statuses(tokenizer) == [200] * QUOTA + [429]


def test_forwarded_for_counts_from_a_named_proxy(tokenizer: Any) -> None:
    """Behind a proxy the operator names, each forwarded address is its own client."""
    assert _statuses(tokenizer, forwarded_allow_ips=("127.0.0.1",)) == [200] * (QUOTA + 1)


def test_junk_keys_do_not_make_new_clients(tokenizer: Any) -> None:
    """A junk bearer key plus the real key as a subprotocol is accepted, but still counts as
    the same client: the socket past max_sockets_per_client is refused."""
    server, port = _serve(GatedEngine(tokenizer), max_sockets_per_client=2)
    url = f"ws://127.0.0.1:{port}/v1/responses"

    async def run() -> dict:
        held = []
        try:
            for i in range(3):
                headers = {"Authorization": f"Bearer junk-{i}"}
                ws = await websockets.connect(url, additional_headers=headers, subprotocols=[KEY_SUBPROTOCOL + KEY])
                held.append(ws)
            return json.loads(await asyncio.wait_for(held[-1].recv(), 10))
        finally:
            for ws in held:
                await ws.close()

    with server:
        refused = asyncio.run(run())
    assert refused["error"]["code"] == "too_many_sockets", refused


def test_settings_flag_parses() -> None:
    from cadenza.cli.main import build_parser
    from cadenza.gateway.server import settings_from_args

    args = build_parser().parse_args(["serve", "--forwarded-allow-ips", "10.0.0.1", "10.0.0.2"])
    assert settings_from_args(args).forwarded_allow_ips == ("10.0.0.1", "10.0.0.2")
    assert settings_from_args(build_parser().parse_args(["serve"])).forwarded_allow_ips == ()


def test_serve_config_is_off_by_default() -> None:
    from cadenza.gateway.server import uvicorn_config

    assert uvicorn_config(None, GatewaySettings()).proxy_headers is False  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    yield
