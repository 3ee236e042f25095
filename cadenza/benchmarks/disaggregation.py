"""`cadenza bench serve --disaggregation NPMD`: the same workload on a colocated `cadenza serve`
and on an NPMD one, started here one after the other (never side by side: they would share
the cores), with the latency ratios and the KV hand-overs' figures. On a few cores each engine
of the split gets its share (--num-cpus-per-worker), so what the split buys (long prompts kept
off the decode engine's steps) competes with what it costs (half the cores per step)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from cadenza.benchmarks.report import free_port, report

# How long a server may take to load its engines and answer /health.
START_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    flags: list[str]


def run_disaggregation_bench(args: argparse.Namespace, run_one: Any) -> dict[str, Any]:  # noqa: ANN401 - run_serve_bench
    """run_one(args) -> summary, per mode; args.url is set to each server in turn."""
    cores = max((os.cpu_count() or 1) // 2, 1)
    split = ["--disaggregation", args.disaggregation, "--num-cpus-per-worker", str(args.split_cpus or cores)]
    modes = [Mode("colocated", []), Mode(args.disaggregation, split)]
    result: dict[str, Any] = {"serve_args": args.serve_args, "modes": {}}
    for mode in modes:
        with _server([*shlex.split(args.serve_args), *mode.flags], args.api_key) as url:
            here = {"url": url, "output": None, "plot": None, "compare_offline": False}
            one = run_one(argparse.Namespace(**vars(args) | here))
            one["kv_transfer"] = _stats(url, args.api_key).get("kv_transfer")
            result["modes"][mode.name] = one
    base, other = (result["modes"][m.name] for m in modes)
    kinds = ("ttft_ms", "itl_ms", "tpot_ms")
    ratios = {f"{k}_{q}": _ratio(other[k][q], base[k][q]) for k in kinds for q in ("p50", "p99")}
    if base["by_prompt"] and other["by_prompt"]:  # the short chats apart: what long prefills disturb
        short, short_base = other["by_prompt"]["short"], base["by_prompt"]["short"]
        ratios |= {f"short_itl_ms_{q}": _ratio(short["itl_ms"][q], short_base["itl_ms"][q]) for q in ("p50", "p99")}
    result["ratios_split_over_colocated"] = ratios
    return report(result, args.output)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


@contextlib.contextmanager
def _server(flags: list[str], api_key: str | None) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cadenza.cli.main", "serve", "--port", str(port), *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"cadenza serve {' '.join(flags)} did not come up")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _stats(url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/stats", headers=headers), timeout=30) as r:
        return json.loads(r.read())["engine"]
