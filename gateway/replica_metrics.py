"""Metrics from every Serve replica at any replica's /metrics.

Under Ray Serve the router sends a scrape to one replica, whose registry knows only its own
requests. Each replica therefore posts its metrics text to one detached actor per
application (`board_name`) every `metrics_push_interval_s`, and a replica answering /metrics
returns its own (rendered now) merged with the others' latest, each sample labelled with its
`replica`. A replica that stops posting (gone, or stuck) drops out after three intervals.
This keeps the one /metrics URL (and vLLM's names) that `cadenza serve` has; on the same timer
each replica also records its samples through Ray's metrics export (ray_metrics.py), for a
cluster's Prometheus that scrapes every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cadenza.gateway.named_actor import NamedActorClient
from cadenza.gateway.ray_metrics import RayMetricsExport

ACTOR_PREFIX = "cadenza-metrics-board"
# A replica silent for this many intervals is left out of the merged view.
STALE_INTERVALS = 3

log = logging.getLogger(__name__)


def board_name(app_name: str, model_name: str) -> str:
    return f"{ACTOR_PREFIX}:{app_name}:{model_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class _BoardActor:
    def __init__(self) -> None:
        self.posts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self.posts[replica] = (time.time(), text)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        cutoff = time.time() - max_age_s
        self.posts = {r: p for r, p in self.posts.items() if p[0] >= cutoff}
        return {replica: text for replica, (_, text) in self.posts.items()}


class MetricsBoard(NamedActorClient):
    """One replica's side: post its metrics on a timer, and merge everyone's for a scrape.
    `render` is bound by the app (start), which owns the metrics."""

    def __init__(self, name: str, replica: str, interval_s: float) -> None:
        self.replica, self.interval_s = replica, interval_s
        super().__init__(name)
        self.task: asyncio.Task | None = None
        self.render: Callable[[], Awaitable[bytes]] | None = None

    def _connect(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        return _BoardActor.options(name=self.name, lifetime="detached", get_if_exists=True).remote()

    def bind(self, render: Callable[[], Awaitable[bytes]]) -> None:
        self.render = render

    def start(self) -> None:
        """Post every interval from the running loop; idempotent (the replica calls it from its
        health check, the first of which comes as it starts, and each scrape does)."""
        if self.task is None and self.render is not None:
            self.task = asyncio.get_running_loop().create_task(self._post_forever())

    async def _post_forever(self) -> None:
        export = RayMetricsExport()
        while True:
            with contextlib.suppress(Exception):  # a missed post only ages this replica's figures
                text = (await self.render()).decode()
                await self._call("post", self.replica, text)
                export.record(text)
            await asyncio.sleep(self.interval_s)

    async def scrape(self, own_text: bytes) -> bytes:
        """Every live replica's metrics, this one's (`own_text`, rendered now) among them."""
        self.start()
        own = own_text.decode()
        await self._call("post", self.replica, own)
        texts = await self._call("fresh", STALE_INTERVALS * self.interval_s)
        return merge({**texts, self.replica: own})


def merge(texts: dict[str, str]) -> bytes:
    """Prometheus texts, one per replica, as one: each sample gains `replica`."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                # Sample is a namedtuple: the same fields, the labels widened.
                merged.samples.append(type(sample)(sample[0], {**sample.labels, "replica": replica}, *sample[2:]))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
