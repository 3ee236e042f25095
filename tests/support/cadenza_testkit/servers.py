"""Servers for the gateway tests: a real `cadenza serve` subprocess, an app served in a thread,
and PacedEngine, an engine double that streams at a set pace."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from cadenza.gateway.server import uvicorn_config
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model
from cadenza.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cadenza.request_limits import RequestLimits

API_KEY = "test-key"
MAX_FRAME_BYTES = 65536
STARTUP_TIMEOUT_S = 300
# The shared server speculates, so every gateway test also checks that greedy output is
# the same with speculation on (n-gram drafts need no second model). Above 8 requests in a
# step it stops, as a CPU deployment would: verifying k extra tokens each no longer pays.
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}  # the smallest chat body
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts"


# A vLLM user's `cadenza serve` line, unchanged: parsed in test_vllm_cli.py, served in test_cli.py.
VLLM_LINE = (
    "--enable-prefix-caching -tp 1 --seed 0 --max-model-len 2k --enable-auto-tool-choice --uvicorn-log-level info"
)


@dataclass
class Server:
    port: int
    process: subprocess.Popen

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/responses"

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.http + path, headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: bytes, key: str = API_KEY) -> tuple[int, dict]:
        """(status, JSON body) of a POST with the key, 4xx and 5xx included."""
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        request = urllib.request.Request(self.http + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def engine_stats(self) -> dict:
        return self.get("/stats")["engine"]["engine"]

    def settled_stats(self) -> dict:
        """/stats once nothing is in flight (requests end asynchronously after their last event;
        30 s at most, then as it is)."""
        for _ in range(300):
            stats = self.get("/stats")
            engine = stats["engine"]["engine"]
            if not stats["gateway"]["in_flight"] and not engine["num_running"] and not engine["num_waiting"]:
                break
            time.sleep(0.1)
        return stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int) -> Iterator[None]:
    """A gateway app on uvicorn in a thread of this process (for tests that need its insides),
    configured as `cadenza serve` configures it (no signals: not the main thread)."""
    config = uvicorn_config(app, dataclasses.replace(app.state.gateway.settings, port=port))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield
    server.should_exit = True
    thread.join(timeout=10)


class PacedEngine:
    """Emits token 42 every `pace` seconds until max_tokens: an engine-shaped clock (an
    EngineClient, cadenza.engine_client)."""

    max_model_len = 2048
    speculative = False

    def __init__(self, pace: float) -> None:
        self.pace = pace
        self.tokenizer = load_tokenizer(*read_model(DEFAULT_MODEL))
        self.running = 0
        self.problem: str | None = None

    @property
    def request_limits(self) -> RequestLimits:  # a property: doubles that skip __init__ have it too
        return RequestLimits(self.tokenizer.vocab_size, self.max_model_len)

    def get_tokenizer(self):  # noqa: ANN201
        return self.tokenizer

    async def generate(self, prompt: dict, params, request_id: str, **_) -> AsyncIterator[RequestOutput]:  # noqa: ANN001, ANN003
        self.running += 1
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.pace)
                last = i == params.max_tokens - 1
                out = CompletionOutput(0, "a", [42], None, None, "length" if last else None)
                metrics = RequestMetrics(time.time(), queue_time=0.01)
                yield RequestOutput(request_id, None, [], None, [out], last, 0, [metrics])
        finally:
            self.running -= 1

    async def check_health(self) -> None:
        if self.problem:
            raise RuntimeError(self.problem)

    async def stats(self) -> dict:
        return {"running": self.running}


@contextlib.contextmanager
def launch_server(args: list[str], log_name: str) -> Iterator[Server]:
    """A real `cadenza serve` subprocess with these flags, once /health says ok; it joins the
    session's Ray instance when this process holds one (named: a server joins no cluster by
    itself), so only the model load is paid."""
    port = free_port()
    cmd = [sys.executable, "-m", "cadenza.cli.main", "serve", "--port", str(port), *_session_ray(), *args]
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / log_name, "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    srv = Server(port, process)
    try:
        _wait_healthy(srv, log.name)
        yield srv
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _session_ray() -> list[str]:
    import ray

    return ["--ray-address", ray.get_runtime_context().gcs_address] if ray.is_initialized() else []


def _wait_healthy(srv: Server, log_name: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if srv.process.poll() is not None:
            raise RuntimeError(f"cadenza serve exited with {srv.process.returncode}; see {log_name}")
        try:
            if srv.get("/health")["status"] == "ok":
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"cadenza serve did not become healthy in {STARTUP_TIMEOUT_S} s")
        time.sleep(1)


class GatedEngine(PacedEngine):
    """PacedEngine that streams `chunk` until its `gate` opens, then finishes with "stop" (when
    `gated`; otherwise it stops at max_tokens as PacedEngine does)."""

    def __init__(self, tokenizer: Any, pace: float = 0.01, gated: bool = False, chunk: str = "a") -> None:
        self.pace, self.tokenizer, self.gated, self.chunk = pace, tokenizer, gated, chunk
        self.running, self.problem = 0, None
        self.gate = threading.Event()

    async def generate(self, prompt: dict, params: Any, request_id: str, **_: Any) -> AsyncIterator[RequestOutput]:
        self.running += 1  # **_: cache_salt, sent with an API key
        try:
            for i in range(10**9 if self.gated else params.max_tokens):
                await asyncio.sleep(self.pace)
                last = self.gate.is_set() if self.gated else i == params.max_tokens - 1
                reason = ("stop" if self.gated else "length") if last else None
                out = CompletionOutput(0, self.chunk, [42], None, None, reason)
                yield RequestOutput(request_id, None, [], None, [out], last, 0, [RequestMetrics(time.time())])
                if last:
                    return
        finally:
            self.running -= 1
