"""A second Ray node on this machine, joined to the test session's loopback-only instance, so
Serve tests run their replicas on two nodes (two raylets, as two `ray start` processes on two
machines would be) without anything listening beyond loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ray

from cadenza_testkit.servers import free_port

# `ray start`, except that a loopback node IP stays loopback: Ray otherwise rewrites 127.0.0.1
# into the host's routable address (services.resolve_ip_for_localhost), and would then look
# for the loopback-only head there. cadenza.actors.local_ray.init_local_ray explains the same
# rewrite for the head; its switch (ENABLE_RAY_CLUSTER) would also refuse a second node.
RAY_START = (
    "import sys; import ray._private.services as services; services.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)
# Ports that default to fixed numbers and would clash with the head's on the same address.
AGENT_PORTS = (
    "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
)  # fmt: skip


@contextlib.contextmanager
def second_node(num_cpus: int, log: Path, join_timeout_s: float = 60.0) -> Iterator[str]:
    """Joins a node with `num_cpus` to the running instance for the block; yields its node id.
    Its processes (raylet, agents, workers) go with it at the end."""
    port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    args = [sys.executable, "-c", RAY_START, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"]
    args += [f"--num-cpus={num_cpus}", "--block", "--disable-usage-stats"]
    args += [f"--{flag}={free_port()}" for flag in AGENT_PORTS]
    with log.open("w") as out:
        node = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + join_timeout_s
        while not (joined := {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before):
            assert node.poll() is None and time.monotonic() < deadline, f"the second node did not join: {log}"
            time.sleep(0.2)
        yield joined.pop()
    finally:
        os.killpg(node.pid, signal.SIGTERM)  # `ray start --block` drains and stops its node's processes
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
