"""Benchmarks report alike: indented JSON on stdout, and the same in a file when asked; latency
percentiles in one shape."""

from __future__ import annotations

import json
import statistics
from typing import Any


def report(result: dict[str, Any], path: str | None) -> dict[str, Any]:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return result


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / mean of seconds, in milliseconds (bench serve and compare_offline)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {
        "p50": pick(0.5) * 1e3,
        "p90": pick(0.9) * 1e3,
        "p99": pick(0.99) * 1e3,
        "mean": statistics.mean(values) * 1e3,
    }


def free_port() -> int:
    """A loopback port nothing listens on now (for a server a benchmark starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
