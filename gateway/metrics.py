"""Prometheus metrics at /metrics, vLLM's set under a prefix (`cadenza:` by default;
--metrics-prefix vllm gives vLLM's exact names, so its Grafana dashboard and alert rules
match as they are).

Per-request latencies and token counts are observed here in the gateway, where the user's
clock runs: TTFT, inter-token latency (also as vLLM's older time_per_output_token_seconds),
each request's mean TPOT, queue, prefill (scheduled to first token), decode (first token to
finish), inference (scheduled to finish) and end-to-end times, prompt and generation lengths.
Engine state (running/waiting, KV usage, prefix-cache queries and hits, preemptions,
speculative drafts and acceptances) is read from the engine's stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cadenza.engine_client import EngineClient
from cadenza.errors import EngineDeadError
from cadenza.stats import KVTransferStats, ServingStats, SpecDecodeStats

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_GAP = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_LENGTH = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    def __init__(self, model_name: str, prefix: str = "cadenza") -> None:
        self.model_name, self.prefix = model_name, prefix
        self.registry = CollectorRegistry()
        r, labels, p = self.registry, ["model_name"], prefix + ":"
        histogram = lambda name, doc, buckets: Histogram(p + name, doc, labels, buckets=buckets, registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", _TOKEN_GAP)
        self.tpot_alias = histogram("time_per_output_token_seconds", "Time between output tokens.", _TOKEN_GAP)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "A request's mean TPOT.", _TOKEN_GAP)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduling to first token.", _LATENCY)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", _LATENCY)
        self.inference = histogram("request_inference_time_seconds", "First scheduling to finish.", _LATENCY)
        self.prompt_lengths = histogram("request_prompt_tokens", "Prompt tokens per request.", _LENGTH)
        self.generation_lengths = histogram("request_generation_tokens", "Output tokens per request.", _LENGTH)
        self.max_generation = histogram(
            "request_max_num_generation_tokens", "Output tokens of a request's longest sequence.", _LENGTH
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", labels, registry=r)
        self.success = Counter(
            p + "request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r
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
                self.m.tpot_alias.labels(self.label).observe(gap)
        self.last_token_at = now
        self.m.generation_tokens.labels(self.label).inc(count)

    def finish(self, reason: str, prompt_tokens: int, times: RequestTimes, output_tokens: int = 0) -> None:
        """times: the request's clock (arrival, queue time, first token, finish)."""
        m, label, now = self.m, self.label, times.finished
        m.e2e.labels(label).observe(now - times.arrival)
        m.prompt_tokens.labels(label).inc(prompt_tokens)
        m.success.labels(label, reason).inc()
        m.prompt_lengths.labels(label).observe(prompt_tokens)
        m.generation_lengths.labels(label).observe(output_tokens)
        m.max_generation.labels(label).observe(output_tokens)
        if times.queue_time is None:
            return
        m.queue.labels(label).observe(times.queue_time)
        scheduled = times.arrival + times.queue_time
        m.inference.labels(label).observe(max(now - scheduled, 0.0))
        if times.first_token is not None:
            m.prefill.labels(label).observe(max(times.first_token - scheduled, 0.0))
            m.decode.labels(label).observe(now - times.first_token)
            if output_tokens > 1:
                m.request_tpot.labels(label).observe((now - times.first_token) / (output_tokens - 1))


@dataclass(frozen=True, slots=True)
class RequestTimes:
    arrival: float
    queue_time: float | None  # arrival to first scheduling, as the engine measured it
    first_token: float | None
    finished: float


class _EngineCollector:
    """Engine gauges and counters from the stats snapshot taken at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.m.engine_stats
        if stats is None:
            return
        engine, kv, label, p = stats.engine, stats.engine.kv_cache, [self.m.model_name], self.m.prefix + ":"
        for name, doc, value in (
            (p + "num_requests_running", "Requests running in the engine.", engine.num_running),
            (p + "num_requests_waiting", "Requests waiting in the engine.", engine.num_waiting),
            (p + "kv_cache_usage_perc", "Fraction of KV blocks in use.", kv.usage),
            (p + "gpu_cache_usage_perc", "Fraction of KV blocks in use (vLLM's older name).", kv.usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        yield from _counters(label, (
            (p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.queries),
            (p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.hits),
            (p + "num_preemptions", "Requests preempted.", engine.num_preemptions),
        ))  # fmt: skip
        if engine.step_tokens is not None:
            steps = HistogramMetricFamily(
                p + "iteration_tokens_total", "Tokens per engine step.", labels=["model_name"]
            )
            steps.add_metric(label, engine.step_tokens.cumulative(), sum_value=engine.step_tokens.total_tokens)
            yield steps
        yield from self._spec_decode(engine.spec_decode, label, p)
        yield from self._kv_transfer(stats.kv_transfer, label, p)

    def _kv_transfer(self, moved: KVTransferStats | None, label: list[str], p: str) -> Iterator[Metric]:
        """KV moved between engines: prefill/decode disaggregation's hand-overs, or under Serve
        the pulls between replicas (gateway/peer_kv.py); absent (not zero) without either."""
        if moved is None:
            return
        yield from _counters(label, (
            (p + "kv_transfer_handoffs", "Prompts whose KV came from another engine.", moved.num_handoffs),
            (p + "kv_transfer_blocks_imported", "KV blocks imported from another engine.", moved.num_blocks_imported),
            (p + "kv_transfer_blocks_skipped", "KV blocks offered that it held.", moved.num_blocks_skipped),
            (p + "kv_transfer_blocks_streamed", "KV blocks moved during their prefill.", moved.num_blocks_streamed),
            (p + "kv_transfer_blocks_pulled", "KV blocks copied from a shared cache.", moved.num_blocks_pulled),
            (p + "kv_transfer_bytes", "KV bytes imported from another engine.", moved.num_bytes),
            (p + "kv_transfer_seconds", "Time requests waited for KV hand-overs.", moved.seconds),
            (p + "kv_transfer_fallbacks", "Hand-overs or pulls that fell back to recomputing.", moved.num_fallbacks),
            (p + "kv_transfer_prefill_failures", "Requests whose prefill engine died.", moved.num_prefill_failures),
            (
                p + "kv_transfer_decode_resumes",
                "Requests resumed after their decode engine died.",
                moved.num_decode_resumes,
            ),
        ))  # fmt: skip

    def _spec_decode(self, spec: SpecDecodeStats | None, label: list[str], p: str) -> Iterator[Metric]:
        """Speculative decoding counters; absent (not zero) when the engine does not speculate."""
        if spec is None:
            return
        yield from _counters(label, (
            (p + "spec_decode_num_drafts", "Verification steps that had drafts.", spec.num_drafts),
            (p + "spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
            (p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ))  # fmt: skip
        per_pos = CounterMetricFamily(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0 first).",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(spec.accepted_per_position):
            per_pos.add_metric([*label, str(position)], value)
        yield per_pos


def _counters(label: list[str], rows: tuple[tuple[str, str, float], ...]) -> Iterator[Metric]:
    """One counter family per (name, doc, value), labelled with the model."""
    for name, doc, value in rows:
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric(label, value)
        yield counter
