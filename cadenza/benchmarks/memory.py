"""Resident memory of the serving tree, read from /proc: the peak (VmHWM) and current (VmRSS)
resident set of the engine, its workers and the gateway, and, counted apart, of Ray's own
processes (GCS, raylet, dashboard, agents, monitors, idle workers) of the same Ray session.

Megabytes are 10^6 bytes. A process that is the engine and the gateway at once (the
in-process server), or the engine and its one worker (the local executor), is counted once
in the tree's sums. Sums of RSS count pages shared between processes (libraries, a weights
file several workers map) once per process: an upper bound of the tree's footprint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import msgspec
import psutil

MB = 1_000_000

# Ray's own processes: binaries by name, Python services by the script they run. Ray's worker
# processes retitle themselves "ray::<what they run>" (ray::IDLE, ray::DashboardAgent, ...),
# ours included: the engine and worker actors are told apart by pid, not by title.
RAY_BINARIES = ("raylet", "gcs_server", "plasma_store", "redis-server")
RAY_SCRIPTS = (
    "ray/dashboard/",
    "ray/_private/log_monitor.py",
    "ray/autoscaler/_private/monitor.py",
    "ray/_private/runtime_env/agent/",
    "ray/_private/ray_process_reaper.py",
    "ray/util/client/server",
    "ray/_private/workers/default_worker.py",
)
SESSION_RE = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")


class ProcessMemory(msgspec.Struct):
    pid: int
    name: str
    peak_mb: float  # VmHWM: the largest resident set the process has had
    rss_mb: float  # VmRSS: its resident set now


class RayOwnMemory(msgspec.Struct):
    """session: the Ray session found (None: none, so no processes are counted)."""

    session: str | None
    total_mb: float  # sum of the processes' peaks
    total_rss_mb: float
    processes: list[ProcessMemory]


class MemoryReport(msgspec.Struct):
    engine: ProcessMemory | None
    workers: list[ProcessMemory]
    gateway: ProcessMemory | None
    ray_own: RayOwnMemory
    serving_tree_peak_mb: float  # sum of the peaks of the distinct engine, worker and gateway pids
    serving_tree_rss_mb: float
    weight_mb: float | None  # the resident weights, as the engine reports them
    unreadable: dict[str, str]  # pid -> why its /proc status could not be read


def read_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as fields; OSError when the process is gone or not readable."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def _kb_field(status: dict[str, str], name: str) -> int:
    """A "<n> kB" field in bytes (0 when absent: a kernel thread or a zombie has no memory)."""
    value = status.get(name, "").split()
    return int(value[0]) * 1024 if value else 0


def process_memory(pid: int) -> ProcessMemory:
    """One process's peak and current RSS; OSError when it cannot be read."""
    status = read_status(pid)
    peak, rss = _kb_field(status, "VmHWM"), _kb_field(status, "VmRSS")
    return ProcessMemory(pid, _label(pid, status.get("Name", "?").strip()), peak / MB, rss / MB)


def _label(pid: int, comm: str) -> str:
    """A name that says what runs: a Ray worker's title (ray::IDLE, ray::EngineActor...) or
    the Python script, where the kernel's 15-character name says only "python"."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return comm
    if args and args[0].startswith("ray::"):
        return args[0].strip()
    script = next((arg for arg in args[1:3] if arg.endswith(".py")), None)
    return f"{comm} {os.path.basename(script)}" if script else comm


def own_peak_rss_bytes() -> int:
    """This process's VmHWM in bytes."""
    return _kb_field(read_status(os.getpid()), "VmHWM")


def own_rss_bytes() -> int:
    return _kb_field(read_status(os.getpid()), "VmRSS")


def reset_own_peak_rss() -> bool:
    """Start this process's VmHWM again from its current RSS (Linux 4.0+: "5" to clear_refs),
    so a later peak is of what ran after, not of earlier probes; False where refused."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def is_ray_process(name: str, cmdline: list[str]) -> bool:
    """Whether a process is one of Ray's own (or a Ray worker) by its name and command line."""
    if name in RAY_BINARIES or name.startswith("ray::"):
        return True
    if cmdline and cmdline[0].startswith("ray::"):  # a retitled worker whose name was truncated
        return True
    text = " ".join(cmdline)
    return any(script in text for script in RAY_SCRIPTS)


def ray_session_of(pids: Iterable[int]) -> str | None:
    """The Ray session the given processes belong to: the raylet that is an ancestor of one
    (an actor is its raylet's child), else a GCS or raylet that one of them started (the
    driver of a local instance). None when there is none (no Ray, or an in-process server)."""
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            related = proc.parents() + proc.children(recursive=False)
        except psutil.Error:
            continue
        for other in related:
            try:
                if other.name() in ("raylet", "gcs_server"):
                    match = SESSION_RE.search(" ".join(other.cmdline()))
                    if match:
                        return match.group(0)
            except psutil.Error:
                continue
    return None


def _session_roots(session: str) -> tuple[list[int], set[int]]:
    """(pids of the current user's Ray processes that name the session, the raylets among them)."""
    user = psutil.Process().username()
    named, raylets = [], set()
    for proc in psutil.process_iter(["pid", "name", "cmdline", "username"]):
        info = proc.info
        if info["username"] != user or not info["cmdline"]:
            continue
        if session in " ".join(info["cmdline"]) and is_ray_process(info["name"] or "", info["cmdline"]):
            named.append(info["pid"])
            if info["name"] == "raylet":
                raylets.add(info["pid"])
    return named, raylets


def ray_own_pids(session: str, exclude: set[int]) -> list[int]:
    """Ray's own processes of a session: those whose command line names it, and everything
    its raylets started (agents, idle workers), less `exclude` (the serving tree)."""
    named, raylets = _session_roots(session)
    found = set(named)
    for raylet in raylets:
        try:
            found |= {child.pid for child in psutil.Process(raylet).children(recursive=True)}
        except psutil.Error:
            continue
    return sorted(found - exclude)


def _read_all(pids: Iterable[int], unreadable: dict[str, str]) -> list[ProcessMemory]:
    out = []
    for pid in pids:
        try:
            out.append(process_memory(pid))
        except OSError as e:
            unreadable[str(pid)] = f"{type(e).__name__}: {e}"
    return out


def _one(pid: int | None, unreadable: dict[str, str]) -> ProcessMemory | None:
    found = _read_all([pid], unreadable) if pid else []
    return found[0] if found else None


def ray_own_memory(serving_pids: list[int], unreadable: dict[str, str]) -> RayOwnMemory:
    """Ray's own processes of the session the first of `serving_pids` (engine first) is in:
    the gateway may also drive another session (a test suite's shared Ray instance)."""
    session = ray_session_of(serving_pids)
    procs = _read_all(ray_own_pids(session, set(serving_pids)), unreadable) if session else []
    return RayOwnMemory(session, sum(p.peak_mb for p in procs), sum(p.rss_mb for p in procs), procs)


def serving_memory_report(
    engine_pid: int | None, worker_pids: list[int], gateway_pid: int | None, weight_bytes: int | None
) -> MemoryReport:
    """The report for a serving tree on this machine, given its pids (from /stats)."""
    unreadable: dict[str, str] = {}
    engine, gateway = _one(engine_pid, unreadable), _one(gateway_pid, unreadable)
    workers = _read_all(dict.fromkeys(worker_pids), unreadable)
    tree = {p.pid: p for p in [engine, gateway, *workers] if p is not None}  # a pid counted once
    serving_pids = [pid for pid in dict.fromkeys((engine_pid, *worker_pids, gateway_pid)) if pid]
    return MemoryReport(
        engine=engine,
        workers=workers,
        gateway=gateway,
        ray_own=ray_own_memory(serving_pids, unreadable),
        serving_tree_peak_mb=sum(p.peak_mb for p in tree.values()),
        serving_tree_rss_mb=sum(p.rss_mb for p in tree.values()),
        weight_mb=weight_bytes / MB if weight_bytes else None,
        unreadable=unreadable,
    )
