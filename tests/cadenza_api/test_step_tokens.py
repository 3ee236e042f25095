"""Tokens per engine step as vLLM's iteration_tokens_total histogram: buckets as vLLM's,
cumulative as Prometheus reads them."""

from __future__ import annotations

import msgspec

from cadenza.stats import STEP_TOKEN_BUCKETS, EngineStats, StepTokenStats


def test_steps_fall_in_vllms_buckets_cumulatively() -> None:
    stats = StepTokenStats()
    assert stats.cumulative()[-1] == ("+Inf", 0)  # no step yet: every bucket empty
    for tokens in (1, 8, 9, 2048, 20000):
        stats.record(tokens)
    cumulative = dict(stats.cumulative())
    assert (cumulative["1.0"], cumulative["8.0"], cumulative["16.0"], cumulative["2048.0"]) == (1, 2, 3, 4)
    assert cumulative[str(float(STEP_TOKEN_BUCKETS[-1]))] == 4 and cumulative["+Inf"] == 5
    assert (stats.num_steps, stats.total_tokens) == (5, 1 + 8 + 9 + 2048 + 20000)


def test_the_counts_cross_the_actor_boundary() -> None:
    stats = StepTokenStats()
    stats.record(3)
    raw = msgspec.msgpack.encode(stats)
    assert msgspec.msgpack.decode(raw, type=StepTokenStats) == stats
    assert EngineStats.__struct_fields__[-1] == "step_tokens"
