"""The Ray instance `cadenza serve` starts for itself listens on loopback only."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

# Run in a child process: the test session may already hold a Ray instance (ray_cluster), and
# it is this process tree's sockets we list. The child gets a fresh Ray temp dir (RAY_TMPDIR:
# its session files) and no RAY_ADDRESS, so ensure_ray starts a private instance as `cadenza
# serve` does, whatever other Ray instances run on this machine.
CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import psutil
    import ray

    from cadenza.actors.local_ray import ensure_ray

    ensure_ray(1)
    try:
        @ray.remote
        def pid():
            return os.getpid()

        ray.get(pid.remote())  # a worker, with its own gRPC server
        wanted = {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}
        me, deadline, seen = psutil.Process(), time.monotonic() + 30, {}
        while True:
            sockets, names = [], set()
            for p in [me, *me.children(recursive=True)]:
                try:
                    name = p.name()
                    for c in p.net_connections(kind="tcp"):
                        if c.status == psutil.CONN_LISTEN:
                            sockets.append([name, p.pid, c.laddr.ip, c.laddr.port])
                            names.add(name)
                except psutil.NoSuchProcess:
                    pass
            if wanted <= names or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(2)  # late starters (metrics servers) too
        for p in [me, *me.children(recursive=True)]:
            try:
                name = p.name()
                sockets += [[name, p.pid, c.laddr.ip, c.laddr.port]
                            for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            except psutil.NoSuchProcess:
                pass
        print(json.dumps({"node_ip": ray.util.get_node_ip_address(), "sockets": sockets}))
    finally:
        ray.shutdown()
    """
)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1
    return address.is_loopback


def test_loopback_helper_knows_its_addresses() -> None:
    assert all(map(_loopback, ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1", "fe80::1"]))


def test_the_local_ray_instance_listens_on_loopback_only() -> None:
    tmp = tempfile.mkdtemp(prefix="cz-ray-", dir="/tmp")  # short: Ray's unix socket paths live here
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CADENZA_RAY_NODE_IP")}
    env["RAY_TMPDIR"] = tmp
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        raise AssertionError(f"the Ray child did not finish in time:\n{err[-3000:]}") from None
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # whatever Ray left in the child's session
        except ProcessLookupError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    assert child.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["node_ip"] == "127.0.0.1"
    sockets = {tuple(s) for s in report["sockets"]}
    names = {name for name, *_ in sockets}
    # It started its own instance (did not join one) and we saw its servers.
    assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, sorted(sockets)
    public = sorted(s for s in sockets if not _loopback(s[2]))
    assert not public, f"Ray listens beyond loopback: {public}"
