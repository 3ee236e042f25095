"""Where the actor runtime's Ray comes from: the cluster the user names (`--ray-address`,
$RAY_ADDRESS, `AsyncLLM(ray_address=...)`), else a private local instance of this process
that listens on loopback only; a process that already holds Ray keeps it.

`cadenza serve`, `AsyncLLM` and the test suite all start Ray through here, so no Ray port
(GCS, raylet, workers, agents, metrics) is reachable from the network unless the user asks,
and a server never lands in another application's cluster because it happened to be there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import ray

LOOPBACK = "127.0.0.1"
NODE_IP_ENV = "CADENZA_RAY_NODE_IP"
ADDRESS_ENV = "RAY_ADDRESS"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# ray.init's own word for "start a new instance": naming it is the same as naming nothing.
PRIVATE_ADDRESS = "local"
# How long a named cluster has to answer, per check (TCP connect, then one GCS call). Why
# check at all: ray.init on an address where no GCS answers retries rather than fails,
# measured here (Ray 2.60, refused port): 12 s per attempt (5 s connect + 5 s pubsub + 2 s),
# still waiting when killed after 200 s.
PROBE_TIMEOUT_S = 3.0
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


def named_ray_address(address: str | None = None) -> str | None:
    """The cluster to join: `address` (--ray-address, AsyncLLM's ray_address), else
    $RAY_ADDRESS; None when neither names one ("" and "local" name none), which means a
    private instance. Never a cluster merely found on this host: that takes "auto"."""
    named = address or os.environ.get(ADDRESS_ENV) or None
    return None if named == PRIVATE_ADDRESS else named


def ensure_ray(min_cpus: int, address: str | None = None) -> str:
    """Ray for this process, and where it is, in words (for a log line):
    - already initialised here (the test suite's one shared instance, a Ray Serve replica, a
      script's own ray.init): used as it is, whatever `address` says;
    - a cluster named by `address` or $RAY_ADDRESS (see named_ray_address): joined, once
      probe_gcs has heard its GCS answer; else ConnectionError naming it, within seconds;
    - else a new private instance (init_local_ray) with at least one logical CPU per worker,
      even when another Ray instance runs on this host."""
    if ray.is_initialized():
        return f"the Ray instance this process holds (GCS {_gcs_address()})"
    named = named_ray_address(address)
    if named is None:
        init_local_ray(max(os.cpu_count() or 1, min_cpus), logging_level="warning")
        return f"a private Ray instance (GCS {_gcs_address()})"
    join_ray(named, logging_level="warning")
    return f"the Ray cluster at {named} (GCS {_gcs_address()})"


def join_ray(address: str, **init_kwargs: Any) -> None:
    """Join the cluster at `address`: "host:port" of its GCS, "auto" (the one `ray start` began
    on this host) or "ray://host:port" (Ray Client). Raises ConnectionError, naming it, when
    nothing is found there or its GCS does not answer in PROBE_TIMEOUT_S, rather than waiting
    in ray.init. A cluster that listens on loopback (one init_local_ray started) is joined as
    node 127.0.0.1: Ray would otherwise rewrite its address, and the driver's, to the host's
    routable one, where nothing listens, and wait until it times out."""
    from ray._common.network_utils import is_localhost
    from ray._private import services

    if address.startswith("ray://"):
        _reachable(address, address.removeprefix("ray://"))
        ray.init(address=address, **init_kwargs)
        return
    if address == "auto":  # as ray.init's "auto": the token of this host's cluster, if one is saved
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    with _loopback_kept():
        try:
            gcs = services.canonicalize_bootstrap_address(address)
        except ConnectionError as e:  # "auto" and no cluster on this host
            raise ConnectionError(f"no Ray cluster found for address {address!r}: {e}") from None
    probe_gcs(gcs, named=address)
    loopback = is_localhost(gcs.rsplit(":", 1)[0].strip("[]"))
    options: dict[str, Any] = {"address": gcs, **init_kwargs}
    if loopback:
        options["_node_ip_address"] = LOOPBACK
    _init_keeping_node_ip(options, loopback)


def probe_gcs(gcs: str, named: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raises ConnectionError, naming the address, unless a Ray GCS answers at `gcs`
    ("host:port"): its port accepts a connection and it tells its cluster id, each within
    timeout_s. A GCS that wants a token (Ray 2.60 gives every new local instance one) answers
    too: joined with RAY_AUTH_MODE=token, else an error that says so. Ray itself sends the
    token only to a cluster it found ("auto"), never to an address named; without one its
    ray.init retries for ~20 s before failing."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    shown = gcs if named in (None, gcs) else f"{named} ({gcs})"
    _reachable(shown, gcs, timeout_s)
    with grpc.insecure_channel(gcs) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                _check_token_mode(shown)
                return
            raise ConnectionError(
                f"no Ray GCS answers at {shown}: the port accepts connections, but asked for its cluster "
                f"id it gave {e.code().name} (in {timeout_s:g} s); is this a Ray cluster's GCS address?"
            ) from None


def _check_token_mode(shown: str) -> None:
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        raise ConnectionError(
            f"the Ray cluster at {shown} requires token authentication: set {AUTH_MODE_ENV}=token "
            "(the token comes from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )


def _reachable(shown: str, host_port: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """A TCP connection to host_port opens within timeout_s, else ConnectionError naming `shown`."""
    from ray._common.network_utils import parse_address

    parsed = parse_address(host_port)
    if parsed is None:
        raise ConnectionError(f"Ray address {shown!r} is not host:port")
    try:
        socket.create_connection((parsed[0], int(parsed[1])), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        reason = f"no answer in {timeout_s:g} s" if isinstance(e, TimeoutError) else getattr(e, "strerror", None) or e
        raise ConnectionError(
            f"no Ray cluster answers at {shown}: {reason}; name a running cluster, or none "
            f"(no --ray-address, no ${ADDRESS_ENV}) for a private instance"
        ) from None


def _gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


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
