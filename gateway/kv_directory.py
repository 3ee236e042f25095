"""KVDirectory: which replica of a Serve application caches which KV blocks.

Each replica publishes the block hashes of what its engine computed (a request's prompt and
output, keyed as the prefix cache keys them: kv_cache_manager.hash_block, tenant salt and
all), bounded per replica with the least recently published forgotten. Before computing a
prompt, a replica asks which other replica holds a longer leading run of its blocks than it
does, and pulls those blocks from that replica's engine through the KV connector
(gateway/peer_kv.py). So a conversation the router moves (the session's replica was full,
drained or replaced; a `previous_response_id` continued under another session) keeps its KV,
and a new conversation that shares a long document or system prompt with one cached
elsewhere starts from it.

One named, detached actor per application (`directory_name`), as the response store: replicas
started later find it. It holds hashes and actor handles, never KV. Its view is an estimate:
an engine may have evicted a block since; the export then sends the run it still has and the
request recomputes the rest. Lost (killed, its node gone), it is created again, empty.
"""

from __future__ import annotations

from typing import Any

import ray

from cadenza.actors.disaggregated import HashIndex
from cadenza.gateway.named_actor import NamedActorClient

ACTOR_PREFIX = "cadenza-kv-directory"
# Block hashes remembered per replica (least recently published forgotten): 128 Ki blocks of
# 16 tokens is 2 Mi tokens of KV, more than a CPU replica's pool holds.
MAX_HASHES_PER_REPLICA = 1 << 17


def directory_name(app_name: str, model_name: str) -> str:
    return f"{ACTOR_PREFIX}:{app_name}:{model_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class _DirectoryActor:
    def __init__(self) -> None:
        # replica -> (its engine's generation, its engine actor, the hashes it published)
        self.replicas: dict[str, tuple[int, Any, HashIndex]] = {}
        self.hand_overs: list[tuple[str, str, int]] = []  # (from, to, blocks), as drains report them
        self.received: dict[str, list[bytes]] = {}  # replica -> hashes handed to it (it passes them on)

    def publish(self, replica: str, generation: int, engine: Any, hashes: list[bytes]) -> None:  # noqa: ANN401
        entry = self.replicas.get(replica)
        if entry is None or entry[0] != generation:  # new, or its engine was replaced (cache empty)
            entry = self.replicas[replica] = (generation, engine, HashIndex(MAX_HASHES_PER_REPLICA))
        entry[2].add(hashes)

    def locate(self, replica: str, hashes: list[bytes], min_gain: int) -> tuple[str, Any, int] | None:  # noqa: ANN401
        """The other replica holding the longest leading run of `hashes`, its engine and the
        run's length in blocks, when that run is at least `min_gain` blocks longer than the
        asking replica's own (a short pull costs more than computing what it saves)."""
        own = self.replicas[replica][2].run(hashes) if replica in self.replicas else 0
        best: tuple[str, Any, int] | None = None
        for name, (_, engine, index) in self.replicas.items():
            run = index.run(hashes) if name != replica else 0
            if run >= own + min_gain and (best is None or run > best[2]):
                best = (name, engine, run)
        return best

    def forget(self, replica: str) -> list[bytes]:
        """Drops the replica; returns the hashes other replicas handed it as they drained."""
        self.replicas.pop(replica, None)
        return self.received.pop(replica, [])

    def others(self, replica: str) -> list[tuple[str, Any]]:  # noqa: ANN401
        """The other replicas and their engines, those holding fewest blocks first."""
        others = [(len(index.hashes), name, engine) for name, (_, engine, index) in self.replicas.items()]
        return [(name, engine) for _, name, engine in sorted(others) if name != replica]

    def hand_over(self, source: str, target: str, hashes: list[bytes]) -> None:
        """`target` now holds `source`'s blocks `hashes` (imported as `source` drains)."""
        if target in self.replicas:
            self.replicas[target][2].add(hashes)
            received = self.received.setdefault(target, [])
            received += hashes
            del received[:-MAX_HASHES_PER_REPLICA]
        self.hand_overs.append((source, target, len(hashes)))
        del self.hand_overs[:-64]  # the recent ones: for operators and tests

    def recent_hand_overs(self) -> list[tuple[str, str, int]]:
        return list(self.hand_overs)

    def replicas_known(self) -> list[str]:
        return sorted(self.replicas)


class KVDirectory(NamedActorClient):
    """A replica's side of the directory."""

    def _connect(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        return _DirectoryActor.options(name=self.name, lifetime="detached", get_if_exists=True).remote()

    async def publish(self, replica: str, generation: int, engine: Any, hashes: list[bytes]) -> None:  # noqa: ANN401
        await self._call("publish", replica, generation, engine, hashes)

    async def locate(self, replica: str, hashes: list[bytes], min_gain: int = 1) -> tuple[str, Any, int] | None:  # noqa: ANN401
        return await self._call("locate", replica, hashes, min_gain)

    async def forget(self, replica: str) -> list[bytes]:
        return await self._call("forget", replica)

    async def recent_hand_overs(self) -> list[tuple[str, str, int]]:
        return await self._call("recent_hand_overs")

    async def replicas_known(self) -> list[str]:
        return await self._call("replicas_known")
