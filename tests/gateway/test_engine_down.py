"""A dead (or restarting) engine: /stats answers 503 with the reason, /health 503, and
/metrics still serves the gateway's own metrics; none of them is a 5xx crash of the app."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.errors import EngineDeadError
from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

REASON = "the engine actor died (ActorDiedError); it is being restarted, retry the request"


class DownEngine(PacedEngine):
    async def check_health(self) -> None:
        raise EngineDeadError(REASON)

    async def stats(self) -> dict:
        raise EngineDeadError(REASON)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_stats_health_and_metrics_while_the_engine_is_down() -> None:
    port = free_port()
    app = build_app(DownEngine(pace=0.01), DEFAULT_MODEL, GatewaySettings(port=port))
    with serve_in_thread(app, port):
        base = f"http://127.0.0.1:{port}"
        status, body = _get(base + "/stats")
        assert status == 503 and json.loads(body)["error"]["message"] == REASON
        status, body = _get(base + "/health")
        assert status == 503 and json.loads(body)["status"] == "unhealthy"
        status, body = _get(base + "/metrics")
        assert status == 200 and b"cadenza" in body
