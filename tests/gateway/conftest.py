"""A real `cadenza serve` on SmolLM2 for the gateway tests, started once per session."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key"
MAX_FRAME_BYTES = 65536
STARTUP_TIMEOUT_S = 300
ARTIFACTS = Path(__file__).resolve().parents[1] / ".artifacts"


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
        with urllib.request.urlopen(self.http + path, timeout=30) as r:
            return json.loads(r.read())

    def engine_stats(self) -> dict:
        return self.get("/stats")["engine"]["engine"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(ray_cluster) -> Iterator[Server]:
    """Joins the session's Ray instance (address=auto), so only the model load is paid."""
    port = free_port()
    cmd = [sys.executable, "-m", "cadenza.cli", "serve", "--port", str(port), "--api-key", API_KEY]
    cmd += ["--num-blocks", "2048", "--max-frame-bytes", str(MAX_FRAME_BYTES), "--max-num-batched-tokens", "512"]
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / "serve.log", "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    srv = Server(port, process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"cadenza serve exited with {process.returncode}; see {log.name}")
        try:
            if srv.get("/health")["status"] == "ok":
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"cadenza serve did not become healthy in {STARTUP_TIMEOUT_S} s")
        time.sleep(1)
    yield srv
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()
