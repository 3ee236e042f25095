"""The grammar budget over HTTP (gateway/grammar_budget.py), with an engine double: a grammar
compiles after admission in a worker thread (never on the event loop), within a size cap
and a time budget, once per distinct grammar; grammar requests past the quota get a 429."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

import cadenza.structured_outputs as structured_outputs
from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

HI = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def _serving(**settings: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, GatewayState) of a gateway on a PacedEngine."""
    port = free_port()
    app = build_app(PacedEngine(pace=0.02), DEFAULT_MODEL, GatewaySettings(port=port, **settings))
    with serve_in_thread(app, port):
        yield f"http://127.0.0.1:{port}", app.state.gateway


def _post(url: str, body: dict) -> tuple[int, dict[str, str], dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _chat(schema: dict, **fields: Any) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"model": DEFAULT_MODEL, "messages": HI, "max_tokens": 1, "response_format": fmt, **fields}


def _unique_schema() -> dict:
    """A schema new to this process's verdict cache."""
    return {"type": "object", "properties": {f"k{uuid.uuid4().hex[:8]}": {"type": "string"}}}


def _count_compiles(monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None = None) -> list[str]:
    """Counts llguidance compiles (each is in the list as it begins); with a gate, each waits
    for it: a grammar that compiles for as long as the test likes."""
    compiles: list[str] = []
    real = structured_outputs.validate_grammar

    def counted(grammar: str) -> str:
        compiles.append(grammar)
        if gate is not None:
            gate.wait()
        return real(grammar)

    monkeypatch.setattr(structured_outputs, "validate_grammar", counted)
    return compiles


def test_a_pattern_heavy_oversized_schema_is_refused_with_its_size() -> None:
    patterns = [f"^[a-z]{{1,{i % 50 + 10}}}x{i}(foo|bar|b{i % 13}z)*[0-9]{{2,{i % 9 + 3}}}$" for i in range(4000)]
    groups = [
        {f"p{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns[j : j + 100], j)}
        for j in range(0, 4000, 100)
    ]
    schema = {
        "type": "object",
        "properties": {f"o{k}": {"type": "object", "properties": g} for k, g in enumerate(groups)},
    }
    with _serving() as (url, state):
        status, _, body = _post(url + "/v1/chat/completions", _chat(schema))
        assert status == 400 and body["error"]["code"] == "grammar_too_large"
        assert "bytes compiled; at most 262144 (max_grammar_bytes)" in body["error"]["message"]
        assert body["error"]["param"] == "response_format"
        state.grammars.check_invariants()
        assert state.grammars.in_flight == 0


def test_a_slow_compile_leaves_the_loop_free_and_is_refused_within_its_budget(monkeypatch) -> None:
    gate = threading.Event()
    compiles = _count_compiles(monkeypatch, gate)
    schema = _unique_schema()
    answers: list[tuple[int, dict[str, str], dict]] = []
    with _serving(grammar_compile_timeout_s=0.5) as (url, state):
        try:
            sender = threading.Thread(target=lambda: answers.append(_post(url + "/v1/chat/completions", _chat(schema))))
            sender.start()
            deadline = time.monotonic() + 60
            while not compiles and time.monotonic() < deadline:
                time.sleep(0.01)
            assert compiles, "the compile never began"
            with urllib.request.urlopen(url + "/health", timeout=10) as r:  # while the compile still runs
                assert r.status == 200 and not gate.is_set()
            sender.join(timeout=60)
            status, _, body = answers[0]
            assert status == 400 and body["error"]["code"] == "grammar_too_complex"
            assert "took longer than 0.5 s to compile (grammar_compile_timeout_s)" in body["error"]["message"]
            status, _, body = _post(url + "/v1/chat/completions", _chat(schema))  # known slow: refused at once
            assert status == 400 and body["error"]["code"] == "grammar_too_complex"
            assert len(compiles) == 1
            assert state.grammars.in_flight == 0 and state.admission.in_flight == 0
        finally:
            gate.set()


def test_a_repeated_grammar_is_compiled_once(monkeypatch) -> None:
    compiles = _count_compiles(monkeypatch)
    schema = _unique_schema()
    with _serving() as (url, _):
        for _ in range(3):
            status, _, _ = _post(url + "/v1/chat/completions", _chat(schema))
            assert status == 200
        body = {
            "model": DEFAULT_MODEL,
            "prompt": "hi",
            "max_tokens": 1,
            "structured_outputs": {"json": schema, "strict": False},
        }
        assert _post(url + "/v1/completions", body)[0] == 200
        status, _, body = _post(url + "/v1/chat/completions", _chat({"type": "objectz"}))
        assert status == 400 and "invalid JSON schema: Invalid type: objectz" in body["error"]["message"]
    assert len(compiles) == 2  # the schema once, whoever asked and however; the bad one once


def _open_stream(url: str, body: dict) -> http.client.HTTPConnection:
    """A streamed chat completion that has begun (its first chunk read), left running."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()
    return conn


def test_grammar_requests_past_the_quota_get_429(monkeypatch) -> None:
    schema = _unique_schema()
    with _serving(max_grammar_requests=3, max_grammar_requests_per_client=2) as (url, state):
        streams = [_open_stream(url, _chat(schema, max_tokens=2000, stream=True)) for _ in range(2)]
        status, headers, body = _post(url + "/v1/chat/completions", _chat(schema))
        assert status == 429 and body["error"]["code"] == "too_many_grammar_requests"
        assert "max_grammar_requests_per_client" in body["error"]["message"] and headers["retry-after"]
        status, _, body = _post(url + "/v1/chat/completions", _chat(schema, n=2))
        assert status == 429 and "would pass 3 (max_grammar_requests)" in body["error"]["message"]
        plain = {"model": DEFAULT_MODEL, "messages": HI, "max_tokens": 1}
        assert _post(url + "/v1/chat/completions", plain)[0] == 200  # no grammar: no grammar place
        assert state.grammars.in_flight == 2
        for conn in streams:  # the client leaves: its places come back
            conn.close()
        deadline = time.monotonic() + 60
        while state.grammars.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        state.grammars.check_invariants()
        assert state.grammars.in_flight == 0
        assert _post(url + "/v1/chat/completions", _chat(schema, n=2))[0] == 200
        assert state.grammars.in_flight == 0
