"""Prometheus metrics at /metrics, named like vLLM's under `cadenza:`.

Per-request latencies and token counts are observed here in the gateway, where the user's
clock runs; engine state (running/waiting, KV usage, prefix-cache queries and hits,
preemptions, speculative drafts and acceptances) is read from the engine's stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cadenza.engine_client import EngineClient
from cadenza.errors import EngineDeadError
from cadenza.stats import ServingStats, SpecDecodeStats

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_GAP = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        histogram = lambda name, doc, buckets: Histogram(name, doc, labels, buckets=buckets, registry=r)
        self.ttft = histogram("cadenza:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("cadenza:inter_token_latency_seconds", "Time between output tokens.", _TOKEN_GAP)
        self.e2e = histogram("cadenza:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY)
        self.queue = histogram("cadenza:request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY)
        self.prompt_tokens = Counter("cadenza:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter("cadenza:generation_tokens", "Generated tokens.", labels, registry=r)
        self.success = Counter(
            "cadenza:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r
        )
        self.engine_stats: ServingStats | None = None
        self.registry.register(_EngineCollector(self))

    def request(self) -> RequestMetricsRecorder:
        return RequestMetricsRecorder(self)

    async def render(self, engine: EngineClient) -> bytes:
        """The gateway's own metrics always; the engine's only while it answers (a scrape
        while it is dead or restarting leaves its gauges out rather than failing)."""
        try:
            self.engine_stats = await engine.stats()
        except EngineDeadError:
            self.engine_stats = None
        return generate_latest(self.registry)


class RequestMetricsRecorder:
    """Follows one request's tokens as the client sees them."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.label = metrics.model_name
        self.last_token_at: float | None = None

    def tokens(self, count: int, now: float, arrival: float) -> None:
        if not count:
            return
        if self.last_token_at is None:
            self.m.ttft.labels(self.label).observe(now - arrival)
        else:
            gap = (now - self.last_token_at) / count  # a burst (speculation) spreads over its tokens
            for _ in range(count):
                self.m.itl.labels(self.label).observe(gap)
        self.last_token_at = now
        self.m.generation_tokens.labels(self.label).inc(count)

    def finish(self, reason: str, prompt_tokens: int, now: float, arrival: float, queue_time: float | None) -> None:
        self.m.e2e.labels(self.label).observe(now - arrival)
        if queue_time is not None:
            self.m.queue.labels(self.label).observe(queue_time)
        self.m.prompt_tokens.labels(self.label).inc(prompt_tokens)
        self.m.success.labels(self.label, reason).inc()


class _EngineCollector:
    """Engine gauges and counters from the stats snapshot taken at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.m.engine_stats
        if stats is None:
            return
        engine, kv, label = stats.engine, stats.engine.kv_cache, [self.m.model_name]
        for name, doc, value in (
            ("cadenza:num_requests_running", "Requests running in the engine.", engine.num_running),
            ("cadenza:num_requests_waiting", "Requests waiting in the engine.", engine.num_waiting),
            ("cadenza:kv_cache_usage_perc", "Fraction of KV blocks in use.", kv.usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        for name, doc, value in (
            ("cadenza:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.queries),
            ("cadenza:prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.hits),
            ("cadenza:num_preemptions", "Requests preempted.", engine.num_preemptions),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
        yield from self._spec_decode(engine.spec_decode, label)

    def _spec_decode(self, spec: SpecDecodeStats | None, label: list[str]) -> Iterator[Metric]:
        """Speculative decoding counters; absent (not zero) when the engine does not speculate."""
        if spec is None:
            return
        for name, doc, value in (
            ("cadenza:spec_decode_num_drafts", "Verification steps that had drafts.", spec.num_drafts),
            ("cadenza:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
            ("cadenza:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
        per_pos = CounterMetricFamily(
            "cadenza:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0 first).",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(spec.accepted_per_position):
            per_pos.add_metric([*label, str(position)], value)
        yield per_pos
