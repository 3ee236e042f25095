"""`--log-format json`: one JSON object per line, the request log's line carrying its fields
(id, tokens in and out, TTFT, total, finish reason) for a log pipeline to index."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.log_format import JsonLines
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(JsonLines().format(record))


def test_a_request_logs_one_json_line_with_its_fields() -> None:
    keep, request_log = Keep(), logging.getLogger("cadenza.requests")
    request_log.addHandler(keep)
    request_log.setLevel(logging.INFO)
    settings = GatewaySettings(port=free_port(), log_format="json")
    try:
        with serve_in_thread(build_app(PacedEngine(0.0), DEFAULT_MODEL, settings), settings.port):
            body = json.dumps({"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 3}).encode()
            url = f"http://127.0.0.1:{settings.port}/v1/completions"
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                reply = json.loads(r.read())
    finally:
        request_log.removeHandler(keep)
    line = json.loads(keep.lines[-1])
    assert line["logger"] == "cadenza.requests" and line["level"] == "info" and line["time"].endswith("+00:00")
    assert (line["request_id"], line["output_tokens"], line["finish_reason"]) == (reply["id"], 3, "length")
    assert line["prompt_tokens"] == reply["usage"]["prompt_tokens"] and line["ttft_s"] <= line["total_s"]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log_format must be one of text, json"):
        GatewaySettings(log_format="xml")
