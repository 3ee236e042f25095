"""`cadenza serve` runs its engine in a Ray instance of its own unless told to join one: two
servers side by side each start their own, a third joins one when named, and a named
cluster that does not answer is a one-line error, not a wait."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from cadenza_testkit.servers import free_port
from cadenza_testkit.tiny_models import build_tiny_chat_model

from cadenza.actors.local_ray import probe_gcs

pytestmark = pytest.mark.heavy  # not in make test-quick: servers starting Ray instances of their own

STARTUP_TIMEOUT_S = 300
ENGINE_LINE = re.compile(r"cadenza: engine on (.+) \(GCS (\S+)\)")


@dataclass
class Served:
    child: subprocess.Popen
    port: int
    log: Path

    def engine_line(self) -> tuple[str, str]:
        """(where, GCS address) from the server's `cadenza: engine on ...` line."""
        (found,) = ENGINE_LINE.findall(self.log.read_text())
        return found

    def engine_pid(self) -> int:
        return _get(self.port, "/stats")["engine"]["engine_pid"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def ray_env() -> Iterator[dict[str, str]]:
    """The servers' environment: no RAY_ADDRESS; RAY_AUTH_MODE=token, as a process has whose
    parent started Ray (this suite's, once ray_cluster has run), so a server that joined
    whatever cluster it found on the host (a GCS in the process table) would get in; and a
    fresh, short Ray temp dir (Ray's socket paths live there)."""
    tmp = tempfile.mkdtemp(prefix="cz-ray-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CADENZA_RAY_NODE_IP")}
    env |= {"RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "token"}
    yield env
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def two_servers(model: Path, ray_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    """The second starts once the first serves: the first's cluster is then there to be found,
    as another application's would be."""
    logs = tmp_path_factory.mktemp("servers")
    servers: list[Served] = []
    try:
        for name in ("first", "second"):
            servers.append(_serve(model, ray_env, logs / f"{name}.log"))
            _wait_healthy(servers[-1])
        yield servers
    finally:
        for served in servers:
            _stop(served.child)


def _serve(model: Path, env: dict[str, str], log: Path, *flags: str) -> Served:
    port = free_port()
    cmd = [sys.executable, "-m", "cadenza.cli.main", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--num-blocks", "64", *flags]
    with open(log, "w") as out:  # the child holds its own copy
        child = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Served(child, port, log)


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())


def _wait_healthy(served: Served) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        code = served.child.poll()
        assert code is None, f"cadenza serve exited with {code}:\n{served.log.read_text()[-3000:]}"
        with contextlib.suppress(OSError):
            if _get(served.port, "/health")["status"] == "ok":
                return
        time.sleep(0.5)
    raise AssertionError(f"cadenza serve was not healthy in {STARTUP_TIMEOUT_S} s:\n{served.log.read_text()[-3000:]}")


def _stop(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # whatever Ray left in the server's session


def _tree(pid: int) -> dict[int, str]:
    """pid -> name of a server process and everything below it."""
    root = psutil.Process(pid)
    found = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            found[p.pid] = p.name()
    return found


def test_two_servers_side_by_side_each_run_their_own_ray_instance(two_servers: list[Served]) -> None:
    """Each server's engine actor runs under that server's own GCS and raylet."""
    for served in two_servers:
        tree = _tree(served.child.pid)
        assert served.engine_pid() in tree, f"the engine runs outside its server's tree {tree}"
        assert {"gcs_server", "raylet"} <= set(tree.values()), tree
    (first, first_gcs), (second, second_gcs) = (s.engine_line() for s in two_servers)
    assert first == second == "a private Ray instance"
    assert first_gcs != second_gcs and first_gcs.startswith("127.0.0.1:")


def test_a_server_named_a_cluster_joins_it(
    two_servers: list[Served], model: Path, ray_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--ray-address puts the engine in that cluster (the first server's); no new instance."""
    first = two_servers[0]
    gcs = first.engine_line()[1]
    joined = _serve(model, ray_env, tmp_path / "joined.log", "--ray-address", gcs)
    try:
        _wait_healthy(joined)
        assert joined.engine_line() == (f"the Ray cluster at {gcs}", gcs)
        assert joined.engine_pid() in _tree(first.child.pid)
        assert not {"gcs_server", "raylet"} & set(_tree(joined.child.pid).values())
    finally:
        _stop(joined.child)
    # Ray gives every new local instance a token and sends it to no address named: say so.
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConnectionError, match=re.escape(f"the Ray cluster at {gcs} requires token authentication")):
        probe_gcs(gcs)


def test_a_named_cluster_that_does_not_answer_is_one_line_naming_it(model: Path, ray_env: dict[str, str]) -> None:
    dead = f"127.0.0.1:{free_port()}"  # freed: nothing listens there
    cmd = [sys.executable, "-m", "cadenza.cli.main", "serve", "--model", str(model), "--port", str(free_port())]
    # The bound is for a hang (ray.init waits minutes on a missing GCS); the error comes in
    # about the time it takes to import torch and read the model.
    out = subprocess.run(cmd + ["--ray-address", dead], env=ray_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"cadenza: error: no Ray cluster answers at {dead}")
    assert "Traceback" not in out.stderr
