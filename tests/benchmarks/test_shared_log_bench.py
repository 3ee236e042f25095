"""`cadenza bench shared-log` runs against a real log actor and reports every event acknowledged."""

from __future__ import annotations

import argparse
import json

import pytest


def test_the_shared_log_bench_reports_each_events_acknowledgement(
    ray_cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    from cadenza.benchmarks.shared_log import run_shared_log_bench

    run_shared_log_bench(argparse.Namespace(streams="1,4", events=20, rate=200.0))
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n") :])  # after anything Ray printed
    assert [r["streams"] for r in report["results"]] == [1, 4]
    assert [r["events"] for r in report["results"]] == [20, 80]
    assert all(0 < r["ack_wait_ms_p50"] <= r["ack_wait_ms_p99"] for r in report["results"])
