"""The autoscaling policy on the engines' signals: requests where the work is, and KV usage."""

from __future__ import annotations

from types import SimpleNamespace

from cadenza.gateway.autoscaling import KV_USAGE, RUNNING, WAITING, engine_load_policy


def _ctx(replicas: int, metrics: dict | None, ongoing: float = 0.0, target: int = 4) -> SimpleNamespace:
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target)
    return SimpleNamespace(
        current_num_replicas=replicas, target_num_replicas=replicas, aggregated_metrics=metrics,
        total_num_requests=ongoing, config=config,
    )  # fmt: skip


def test_requests_inside_the_engines_size_the_deployment() -> None:
    quiet = {RUNNING: {"a": 1.0}, WAITING: {"a": 0.0}, KV_USAGE: {"a": 0.1}}
    assert engine_load_policy(_ctx(1, quiet))[0] == 0.25
    busy = {RUNNING: {"a": 4.0, "b": 4.0}, WAITING: {"a": 6.0, "b": 2.0}, KV_USAGE: {"a": 0.2, "b": 0.2}}
    assert engine_load_policy(_ctx(2, busy))[0] == 4.0  # 16 requests in the engines, 4 a replica


def test_a_full_kv_pool_asks_for_more_replicas_than_its_request_count() -> None:
    full = {RUNNING: {"a": 2.0}, WAITING: {"a": 0.0}, KV_USAGE: {"a": 0.96}}
    assert engine_load_policy(_ctx(1, full))[0] == 0.96 / 0.8
    assert engine_load_policy(_ctx(1, full), target_kv_usage=0.5)[0] == 0.96 / 0.5


def test_before_any_report_serve_s_own_count_decides_and_zero_replicas_keep_their_target() -> None:
    assert engine_load_policy(_ctx(2, None, ongoing=12.0))[0] == 3.0
    assert engine_load_policy(_ctx(0, None))[0] == 0
