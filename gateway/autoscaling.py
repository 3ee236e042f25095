"""Serve autoscaling on the engines' own signals.

Each replica reports, through Serve's `record_autoscaling_stats` (serve_app.py), the requests
its engine is running and holding waiting, and the share of its KV pool those requests use
(session pins apart: they give way to requests). `engine_load_policy` sizes the deployment to
the larger of two demands:
- requests: engine requests (running + waiting) over `target_ongoing_requests` per replica,
  Serve's own rule but counted where the work is, so a request still queued inside an engine
  counts, and one Serve handed over but the engine finished does not;
- KV: the mean KV usage over `target_kv_usage` (policy_kwargs, default 0.8): an engine whose
  pool is nearly full preempts and queues long before its request count says it is busy.
Serve then applies min/max_replicas, the up/downscale delays and smoothing factors, and a
replica it stops hands its conversations over first (gateway/peer_kv.py).

    autoscaling_config:
      policy: {policy_function: cadenza.gateway.autoscaling:engine_load_policy}
"""

from __future__ import annotations

from typing import Any

# The metric names replicas report (serve_app.CadenzaDeployment.record_autoscaling_stats).
RUNNING, WAITING, KV_USAGE = "engine_running", "engine_waiting", "engine_kv_usage"
DEFAULT_TARGET_KV_USAGE = 0.8


def engine_load_policy(ctx: Any, target_kv_usage: float = DEFAULT_TARGET_KV_USAGE) -> tuple[float, dict[str, Any]]:  # noqa: ANN401 - Serve's AutoscalingContext
    """The replicas this load wants (Serve rounds and bounds it); no state of its own."""
    replicas = ctx.current_num_replicas
    if replicas == 0:
        return ctx.target_num_replicas, {}
    metrics = ctx.aggregated_metrics or {}
    running, waiting, kv = (metrics.get(name, {}) for name in (RUNNING, WAITING, KV_USAGE))
    if not running:  # no replica has reported yet: Serve's own count of ongoing requests
        requests = ctx.total_num_requests
    else:
        requests = sum(running.values()) + sum(waiting.values())
    by_requests = requests / ctx.config.get_target_ongoing_requests()
    by_kv = replicas * (sum(kv.values()) / len(kv)) / target_kv_usage if kv else 0.0
    return max(by_requests, by_kv), {}
