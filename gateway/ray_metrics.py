"""A Serve replica's metrics through Ray's own metrics export, labelled by replica.

Ray runs a metrics agent on every node and serves what its processes record on the node's
metrics export port (`ray.nodes()[i]["MetricsExportPort"]`, what a KubeRay PodMonitor
scrapes); Serve's metric types add `application`, `deployment` and `replica` tags. Each replica
records its own /metrics samples there on the board's timer, so a cluster's Prometheus sees
every replica without going through the proxy (which answers from one replica at a time; the
board's merged /metrics stays for clients that scrape one URL).

Every sample is exported as a gauge of its current value (a counter's total, a histogram's
buckets with their `le` tag): Ray's counters take increments and its histograms their own
buckets, while these are totals already kept by the replica's registry. Names lose the
characters Ray refuses (`cadenza:x_total` is `cadenza_x_total`; Ray's exporter prefixes
`ray_`). Samples whose labels differ from the first seen for their name are skipped.
"""

from __future__ import annotations

import logging
import re

from prometheus_client.parser import text_string_to_metric_families
from ray.serve.metrics import Gauge

log = logging.getLogger(__name__)

_NOT_ALLOWED = re.compile(r"[^a-zA-Z0-9_]")


def ray_name(sample_name: str) -> str:
    return _NOT_ALLOWED.sub("_", sample_name)


class RayMetricsExport:
    def __init__(self) -> None:
        self.gauges: dict[str, tuple[Gauge, tuple[str, ...]]] = {}

    def record(self, text: str) -> int:
        """Records every sample of a Prometheus text; returns how many were recorded."""
        recorded = 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_created"):  # creation timestamps, not measurements
                    continue
                gauge, keys = self._gauge(sample.name, family.documentation, tuple(sorted(sample.labels)))
                if set(sample.labels) - set(keys):
                    continue
                gauge.set(sample.value, tags={k: str(sample.labels.get(k, "")) for k in keys})
                recorded += 1
        return recorded

    def _gauge(self, name: str, doc: str, keys: tuple[str, ...]) -> tuple[Gauge, tuple[str, ...]]:
        known = self.gauges.get(name)
        if known is None:
            known = self.gauges[name] = (Gauge(ray_name(name), description=doc or name, tag_keys=keys), keys)
        return known
