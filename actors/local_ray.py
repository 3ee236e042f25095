"""Where the actor runtime's Ray comes from: the running cluster when there is one, else a
private local instance that listens on loopback only.

`cadenza serve`, `AsyncLLM` and the test suite all start Ray through here, so no Ray port
(GCS, raylet, workers, agents, metrics) is reachable from the network unless the user asks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import ray

LOOPBACK = "127.0.0.1"
NODE_IP_ENV = "CADENZA_RAY_NODE_IP"
# The object store of a private local instance. Ray's default is 30% of the machine's memory
# (tens of GB on a server), while Cadenza sends it little: requests and outputs travel as
# msgpack in actor calls, weights are read from disk by each worker, and a Compiled Graph's
# channels take a few MB. A small store bounds what it may pin in shared memory.
LOCAL_OBJECT_STORE_BYTES = 256 << 20
OBJECT_STORE_ENV = "CADENZA_OBJECT_STORE_BYTES"
MIN_OBJECT_STORE_BYTES = 75 << 20  # ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES (Ray 2.60)
# Ray's internals for a private instance. By default the raylet starts one idle Python worker
# per logical CPU when the first driver connects, for tasks Cadenza never runs; each holds
# ~80 MB (measured with benchmarks/memory.py, Ray 2.60: 2 CPUs, 665 -> 582 MB of Ray's own
# processes), so a 16-CPU instance would hold ~1.3 GB of them. Actors start their own worker.
# And Ray runs every worker process at nice 15 (worker_niceness), below its own daemons and the
# gateway: on a small host each wake-up of those preempts a model thread, and the step's other
# threads wait for it at the next barrier. The engine and its workers run at the priority of
# the process that serves them instead (see unnice_worker for clusters we join).
LOCAL_RAY_SYSTEM_CONFIG: dict[str, Any] = {"prestart_worker_first_driver": False, "worker_niceness": 0}


def local_object_store_bytes() -> int:
    """$CADENZA_OBJECT_STORE_BYTES, else LOCAL_OBJECT_STORE_BYTES; refused below Ray's minimum
    here, with the variable's name, rather than deep inside ray.init."""
    raw = os.environ.get(OBJECT_STORE_ENV)
    if not raw:
        return LOCAL_OBJECT_STORE_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{OBJECT_STORE_ENV}={raw!r} is not a whole number of bytes") from None
    if value < MIN_OBJECT_STORE_BYTES:
        raise ValueError(f"{OBJECT_STORE_ENV}={value} is below Ray's minimum of {MIN_OBJECT_STORE_BYTES} bytes")
    return value


def local_ray_options(num_cpus: int, node_ip_address: str | None = None) -> dict[str, Any]:
    """ray.init kwargs for a private, local Ray instance: node IP from the argument, else
    $CADENZA_RAY_NODE_IP, else loopback; the object store local_object_store_bytes() and no
    prestarted idle workers (only a new instance takes these: joining a cluster keeps the
    cluster's). Start it with init_local_ray (it needs one more step)."""
    node_ip = node_ip_address or os.environ.get(NODE_IP_ENV) or LOOPBACK
    return dict(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=local_object_store_bytes(),
        _node_ip_address=node_ip,
        _system_config=dict(LOCAL_RAY_SYSTEM_CONFIG),
    )


def init_local_ray(num_cpus: int, node_ip_address: str | None = None, **init_kwargs: Any) -> None:
    """Start a new local Ray instance that listens on loopback only (unless a node IP is given).

    Why it takes more than `_node_ip_address="127.0.0.1"` (Ray 2.60, read from its source and
    checked with `ss`; the test is tests/deploy/test_ray_loopback.py): every component picks its
    bind address from the node IP, and ray.init rewrites a loopback node IP into the host's
    routable one (services.resolve_ip_for_localhost -> get_node_ip_address) unless
    ray_constants.ENABLE_RAY_CLUSTER is false, which is what RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    sets on macOS/Windows, read once when ray is imported. So ENABLE_RAY_CLUSTER is false while
    ray.init resolves the node IP, and the node IP is then 127.0.0.1, so that:
      - GCS, raylet (node manager and object manager) and every worker's gRPC server bind
        127.0.0.1 instead of all interfaces (`*` / `::`), the C++ side choosing
        listen_to_localhost_only when the node IP is "127.0.0.1";
      - the dashboard agent's gRPC, HTTP (52365) and metrics-export servers
        (dashboard/agent.py, http_server_agent.py, reporter_agent.py) and the autoscaler
        monitor's (44217) and headless dashboard's (44227) Prometheus servers (monitor.py,
        dashboard/head.py) bind loopback when `is_localhost(node_ip)`, else 0.0.0.0 / the node IP;
      - the runtime-env agent binds the node IP itself;
      - the dashboard HTTP server (dashboard_host) is not started (include_dashboard=False); the
        headless dashboard process still runs for its metrics port.
    Children take the node IP from their command line, so the flag only matters here, and it is
    put back afterwards. A node IP that is not loopback gives Ray's own defaults: servers on all
    interfaces, advertising that address (for other machines to join, use `ray start` instead).
    """
    from ray._common.network_utils import is_localhost

    options = local_ray_options(num_cpus, node_ip_address)
    system_config = {**options["_system_config"], **init_kwargs.pop("_system_config", {})}
    options = {**options, **init_kwargs, "_system_config": system_config}
    _init_keeping_node_ip(options, is_localhost(options["_node_ip_address"]))


@contextlib.contextmanager
def _loopback_kept(loopback: bool = True) -> Iterator[None]:
    """ENABLE_RAY_CLUSTER off while Ray resolves addresses, so a loopback one stays loopback
    (see init_local_ray); put back afterwards."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = saved and not loopback
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _init_keeping_node_ip(options: dict[str, Any], loopback: bool) -> None:
    with _loopback_kept(loopback):
        ray.init(**options)


def join_ray(**init_kwargs: Any) -> None:
    """Join the running cluster (RAY_ADDRESS, or one started on this machine). A cluster that
    listens on loopback (one init_local_ray started) is joined as node 127.0.0.1: Ray would
    otherwise rewrite its address, and the driver's, to the host's routable one, where nothing
    listens, and wait until it times out. Raises ConnectionError when there is none."""
    from ray._common.network_utils import is_localhost
    from ray._private import services

    with _loopback_kept():
        address = services.canonicalize_bootstrap_address("auto") or "auto"
    loopback = is_localhost(address.rsplit(":", 1)[0])
    options: dict[str, Any] = {"address": address, **init_kwargs}
    if loopback:
        options["_node_ip_address"] = LOOPBACK
    _init_keeping_node_ip(options, loopback)


def ensure_ray(min_cpus: int) -> None:
    """Join the running Ray cluster if there is one (RAY_ADDRESS or a local `ray start`),
    else start a local instance, listening on loopback only, with at least one logical CPU
    per worker."""
    if ray.is_initialized():
        return
    try:
        join_ray(logging_level="warning")
    except ConnectionError:
        if os.environ.get("RAY_ADDRESS"):  # a cluster was asked for: not a private one instead
            raise
        init_local_ray(max(os.cpu_count() or 1, min_cpus), logging_level="warning")


def unnice_worker() -> None:
    """Undo Ray's nice 15 in this actor process (the engine or a worker), so model threads are
    not preempted by every nice-0 process on the node. A joined cluster's workers start niced
    and lowering niceness needs the privilege to: without it, say so and go on."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        logging.getLogger(__name__).warning(
            "this actor runs at nice %d (Ray's worker_niceness) and may not lower it: the model "
            "yields to every other process on the node; start Ray with RAY_worker_niceness=0",
            current,
        )
