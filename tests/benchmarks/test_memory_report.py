"""benchmarks/memory.py: RSS read from /proc for this process, children it spawns, and a fake
Ray session (scripts named like Ray's binaries), and bench serve's best-effort `memory`."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cadenza.benchmarks.memory import (
    MB,
    is_ray_process,
    own_peak_rss_bytes,
    own_rss_bytes,
    process_memory,
    ray_own_pids,
    ray_session_of,
    reset_own_peak_rss,
    serving_memory_report,
)
from cadenza.benchmarks.serve import is_loopback_url, memory_section

HOLD_MB = 150
# The kernel's peak (VmHWM) may trail the RSS it last read by the page counts threads batch
# before publishing (seen: 0.4 MB); the peak tests allow this much.
HWM_SLACK_MB = 10
SESSION = "session_2030-01-02_03-04-05_123456_42"
OTHER_SESSION = "session_2030-01-02_03-04-05_654321_43"


@pytest.fixture
def holder() -> Iterator[subprocess.Popen]:
    """A child that touches HOLD_MB of memory and waits."""
    code = f"x = b'1' * {HOLD_MB * MB}; print('ready', flush=True); input()"  # written, so resident
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    yield child
    child.kill()
    child.wait()


def _touch_and_free(size: int) -> float:
    """Make `size` bytes of fresh pages resident, then unmap them; returns the RSS (MB) while
    they were held. A mapping of its own: a bytes object of that size may reuse heap that is
    already resident once the suite has run for a while (a clean-clone run failed so, at
    1.7 GB of RSS), and then the peak need not move."""
    block = mmap.mmap(-1, size)
    view = ctypes.c_char.from_buffer(block)
    ctypes.memset(ctypes.addressof(view), 1, size)  # written, so resident
    held = process_memory(os.getpid()).rss_mb
    del view
    block.close()
    return held


def test_own_process_peak_covers_a_freed_allocation() -> None:
    before = process_memory(os.getpid())
    assert before.pid == os.getpid() and before.peak_mb >= before.rss_mb > 0
    held = _touch_and_free(100 * MB)
    after = process_memory(os.getpid())
    assert held >= before.rss_mb + 90
    assert after.peak_mb >= held - HWM_SLACK_MB
    assert own_peak_rss_bytes() >= own_rss_bytes() > 0


def test_reset_peak_starts_from_the_current_rss() -> None:
    held = _touch_and_free(100 * MB)
    peak = own_peak_rss_bytes()
    assert peak >= (held - HWM_SLACK_MB) * MB
    if not reset_own_peak_rss():
        pytest.skip("this kernel refuses clear_refs")
    assert own_peak_rss_bytes() < peak - 50 * MB


def test_a_child_process_is_read_by_pid(holder: subprocess.Popen) -> None:
    child = process_memory(holder.pid)
    assert child.peak_mb >= HOLD_MB and child.rss_mb >= HOLD_MB
    assert child.name.startswith("python")
    assert not is_ray_process(child.name, [sys.executable, "-c", "..."])


def test_the_report_counts_a_shared_process_once_and_survives_a_dead_pid(holder: subprocess.Popen) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # The local executor's worker is the engine's process. The gateway is a child of ours, not
    # this process: in the full suite this process drives the shared Ray instance.
    gateway = subprocess.Popen(["sleep", "30"])
    try:
        report = serving_memory_report(holder.pid, [holder.pid, dead.pid], gateway.pid, 538 * MB)
    finally:
        gateway.kill()
        gateway.wait()
    assert report.engine.pid == holder.pid and report.gateway.pid == gateway.pid
    assert [w.pid for w in report.workers] == [holder.pid]
    assert report.serving_tree_peak_mb == pytest.approx(report.engine.peak_mb + report.gateway.peak_mb)
    assert str(dead.pid) in report.unreadable
    assert report.weight_mb == 538
    assert report.ray_own.session is None and report.ray_own.processes == []  # no Ray here


def test_ray_processes_are_told_by_name_and_script() -> None:
    assert is_ray_process("raylet", ["/x/ray/core/src/ray/raylet/raylet", "--flag"])
    assert is_ray_process("gcs_server", ["/x/gcs_server"])
    assert is_ray_process("ray::IDLE", ["ray::IDLE"])
    assert is_ray_process("ray::DashboardA", ["ray::DashboardAgent"])
    assert is_ray_process("python3", ["python3", "-u", "/x/site-packages/ray/_private/log_monitor.py", "--logs-dir=a"])
    assert is_ray_process("python", ["python", "/x/site-packages/ray/dashboard/dashboard.py"])
    assert not is_ray_process("python", ["python", "-m", "pytest", "tests/actors"])
    assert not is_ray_process("uvicorn", ["uvicorn", "app:ray_app"])


def _fake(tmp_path: Path, name: str, body: str) -> Path:
    """A shell script named like a Ray binary: the kernel names the process after the file."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _wait_for(path: Path) -> str:
    for _ in range(200):
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


def test_ray_own_processes_are_those_of_the_servings_session(tmp_path: Path) -> None:
    """A raylet with two children (our engine actor and an idle worker) and another session's
    GCS: Ray's own are the raylet and the idle worker, not the engine, not the other session."""
    engine_file, idle_file, other_file = tmp_path / "engine.pid", tmp_path / "idle.pid", tmp_path / "other.pid"
    body = f"sleep 30 & echo $! > {engine_file}\nsleep 31 & echo $! > {idle_file}\nwait"
    raylet = subprocess.Popen([str(_fake(tmp_path, "raylet", body)), f"--session_name={SESSION}"])
    other_body = f"sleep 32 & echo $! > {other_file}\nwait"
    other = subprocess.Popen([str(_fake(tmp_path, "gcs_server", other_body)), f"--log_dir=/tmp/ray/{OTHER_SESSION}"])
    sleeps: list[int] = []
    try:
        sleeps += [int(_wait_for(f)) for f in (engine_file, idle_file, other_file)]
        engine, idle = sleeps[:2]
        assert ray_session_of([engine]) == SESSION
        assert ray_own_pids(SESSION, exclude={engine}) == sorted([raylet.pid, idle])
        # This process may drive the suite's shared Ray instance: the engine's session wins.
        report = serving_memory_report(engine, [], os.getpid(), None)
        assert report.ray_own.session == SESSION
        assert {p.pid for p in report.ray_own.processes} == {raylet.pid, idle}
        assert report.ray_own.total_mb == pytest.approx(sum(p.peak_mb for p in report.ray_own.processes))
        assert report.weight_mb is None
    finally:
        for pid in sleeps:
            os.kill(pid, signal.SIGKILL)
        for proc in (raylet, other):
            proc.kill()
            proc.wait()


def test_loopback_urls() -> None:
    assert is_loopback_url("http://127.0.0.1:8000") and is_loopback_url("http://localhost:80")
    assert is_loopback_url("http://[::1]:8000")
    assert not is_loopback_url("http://10.1.2.3:8000") and not is_loopback_url("http://example.com")


def test_bench_serve_memory_is_best_effort() -> None:
    assert memory_section("http://127.0.0.1:1", "GET /stats answered HTTP 500") == (
        None,
        "GET /stats answered HTTP 500",
    )
    report, reason = memory_section("http://10.0.0.1:8000", {"engine": {"engine_pid": 1}})
    assert report is None and "not on this machine" in reason
    report, reason = memory_section("http://127.0.0.1:1", {"engine": {"running": 0}, "gateway": {}})
    assert report is None and "engine_pid" in reason
    me = os.getpid()
    stats = {
        "engine": {"engine_pid": me, "worker_pids": [], "engine": {"weight_bytes": 2 * MB}},
        "gateway": {"gateway_pid": me},  # the in-process server: one process
    }
    report, reason = memory_section("http://127.0.0.1:1", stats)
    assert reason is None and report["engine"]["pid"] == me and report["weight_mb"] == 2
    assert report["serving_tree_peak_mb"] == pytest.approx(report["engine"]["peak_mb"])
