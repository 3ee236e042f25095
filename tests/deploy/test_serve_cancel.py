"""Issue #38 under Ray Serve: when a client disconnects, Serve's proxy cancels its request in
the replica, wherever it is. A cancel while the request was being prepared (its template and
tokenizer, after admission) is not an `Exception`, and it once leaked the request's admission
place for good. Driven through a real Serve proxy and replica, serving the gateway app over an
engine double whose preparation waits for as long as the test holds it."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

GUARD_S = 60  # hang guard only: every wait below ends on a condition


class WaitingTokenizer:
    """The model's tokenizer, except that a call made off the event loop (a request's
    preparation, in its worker thread) first waits while the file `hold` exists."""

    def __init__(self, tokenizer: Any, hold: Path) -> None:
        self.tokenizer, self.hold = tokenizer, hold

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.tokenizer, name)
        if callable(value) and not _on_event_loop():
            deadline = time.monotonic() + GUARD_S
            while self.hold.exists() and time.monotonic() < deadline:  # sleeping: no GIL held
                time.sleep(0.01)
        return value


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class OneTokenEngine:
    """An EngineClient (cadenza.engine_client) double: one token per request."""

    max_model_len = 2048
    speculative = False

    def __init__(self, hold: Path) -> None:
        from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model

        self.tokenizer = WaitingTokenizer(load_tokenizer(*read_model(DEFAULT_MODEL)), hold)

    @property
    def request_limits(self) -> Any:
        from cadenza.request_limits import RequestLimits

        return RequestLimits(self.tokenizer.vocab_size, self.max_model_len)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(self, prompt: dict, params: Any, request_id: str, **_: Any) -> AsyncIterator[Any]:
        from cadenza.outputs import CompletionOutput, RequestMetrics, RequestOutput

        out = CompletionOutput(0, "a", [42], None, None, "length")
        yield RequestOutput(request_id, None, [], None, [out], True, 0, [RequestMetrics(time.time())])

    async def check_health(self) -> None:
        return None

    async def stats(self) -> dict:
        return {}


class WaitingPreparation:
    """A Serve replica of the gateway app (as CadenzaDeployment serves it) over OneTokenEngine."""

    def __init__(self, hold: str) -> None:
        self.engine = OneTokenEngine(Path(hold))

    def __serve_build_asgi_app__(self) -> Any:
        from cadenza.gateway.app import build_app
        from cadenza.gateway.settings import GatewaySettings

        return build_app(self.engine, "double", GatewaySettings(), check_host=False)


@pytest.fixture(scope="module")
def waiting_replica(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(the app's URL, the file that holds its preparations while it exists)."""
    import ray
    from cadenza_testkit.servers import free_port
    from ray import serve

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replica cannot import this file
    hold = tmp_path_factory.mktemp("serve_cancel") / "hold"
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deployment = serve.deployment(serve.ingress()(WaitingPreparation), name="WaitingPreparation")
    serve.run(deployment.bind(str(hold)), name="waiting", route_prefix="/waiting")
    try:
        yield f"http://127.0.0.1:{port}/waiting", hold
    finally:
        serve.shutdown()


def _in_flight(url: str) -> int:
    with urllib.request.urlopen(url + "/stats", timeout=GUARD_S) as r:
        return json.loads(r.read())["gateway"]["in_flight"]


def _wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


REQUESTS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
}


@pytest.mark.parametrize("path", sorted(REQUESTS))
def test_a_client_gone_during_preparation_gives_its_place_back(waiting_replica: tuple[str, Path], path: str) -> None:
    url, hold = waiting_replica
    body = json.dumps(REQUESTS[path])
    prefix = url.split("/", 3)[3]
    request = (
        f"POST /{prefix}{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    hold.touch()
    try:
        host, port = url.split("/")[2].split(":")
        with socket.create_connection((host, int(port)), timeout=GUARD_S) as client:
            client.sendall(request.encode())
            _wait_until(lambda: _in_flight(url) == 1, "the request never reached its preparation")
        # The client has gone while its request waits in its preparation: Serve cancels it there.
        _wait_until(lambda: _in_flight(url) == 0, "the cancelled request kept its admission place")
    finally:
        hold.unlink()
