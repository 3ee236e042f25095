"""PeerKVEngine: a Serve replica's engine that starts a prompt from KV another replica cached.

Before a prompt runs, the KV directory (gateway/kv_directory.py) says whether another replica
holds a leading run of its blocks at least `kv_pull_min_tokens` longer than this one's (a short
pull costs more than the tokens it saves); if so, that replica's engine exports those blocks and
this one imports them into its prefix cache through the KV connector (actors/kv_connector), the
hand-over prefill/decode disaggregation uses (replicas on one node copy the blocks straight out
of each other's shared caches: kv_transport ipc), and the request computes only the rest (its
`cached_tokens` counts them). Why pull rather than route to the holder: Serve's router sees a
request's metadata, never its body, so it cannot know a prompt's blocks; the replica holding
the body can, and a turn whose 640-token prefix was pulled reached its first token in about a
quarter of the time a recompute took (docs/bench/moved_session.json). The session router
still keeps a conversation where it is whenever it can, so a pull is the exception: a moved
conversation, or a shared document.

A pull that fails or takes longer than `kv_pull_timeout_s` is dropped and the request
recomputes; the request never fails for it. After each request the replica publishes the
blocks it computed (prompt and output) before the request's stream ends (about a millisecond),
so a client holding a whole answer can send the next turn anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError

from cadenza.actors.async_llm import AsyncLLM
from cadenza.actors.kv_cache_manager import extend_chain
from cadenza.actors.kv_connector.engine_port import prefix_hashes
from cadenza.actors.kv_connector.handoff import move_kv
from cadenza.engine_client import TokensPrompt
from cadenza.gateway.kv_directory import KVDirectory
from cadenza.outputs import RequestOutput
from cadenza.sampling_params import SamplingParams
from cadenza.stats import KVTransferStats, ServingStats

log = logging.getLogger(__name__)
# How long a draining replica with conversations waits for another to hand them to (within
# Serve's graceful_shutdown_timeout_s, 30 s in deploy/serve_config.yaml): a rolling update may
# stop the last old replica before its replacement's engine has started.
HAND_OVER_WAIT_S = 10.0


class PeerKVEngine:
    """An AsyncLLM (prefix caching on) whose prompts may start from a peer replica's KV. Every
    attribute but generate and stats is the engine's own."""

    def __init__(
        self, engine: AsyncLLM, directory: KVDirectory, replica: str, min_tokens: int, timeout_s: float
    ) -> None:
        self.engine, self.directory, self.replica = engine, directory, replica
        self.block_size = engine.config.block_size
        self.min_blocks = max(1, -(-min_tokens // self.block_size))  # whole blocks, rounded up
        self.timeout_s = timeout_s
        self.transfer = KVTransferStats()  # pulls: blocks imported from peers, and fallbacks
        self._tasks: set[asyncio.Task] = set()
        # Known from the start, holding nothing: a replica that drains may hand its KV here.
        directory.actor.publish.remote(replica, engine.num_engine_restarts, engine.engine, [])

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - whatever the engine holds
        return getattr(self.engine, name)

    async def generate(
        self,
        prompt: TokensPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        pace: bool = False,
        cache_salt: str | None = None,
        session_id: str | None = None,
        resume_from: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        ids = prompt.token_ids + list(resume_from or ())  # a re-issued response: what it emitted counts
        chain = prefix_hashes(ids[:-1], self.block_size, cache_salt)  # the last token always runs
        await self._pull(ids, chain, cache_salt)
        out_ids: list[int] = []
        stream = self.engine.generate(
            prompt, sampling_params, request_id, priority, pace, cache_salt, session_id, resume_from
        )
        try:
            async for out in stream:
                if len(out.outputs) == 1:
                    out_ids += out.outputs[0].token_ids
                yield out
        except BaseException:  # failed or abandoned: what it computed is published in the background
            self._publish_later(self._computed(chain, ids, out_ids, cache_salt))
            raise
        # Before the caller's loop ends, so a client that has the whole answer may send the next
        # turn anywhere and have it find these blocks.
        await self._publish(self._computed(chain, ids, out_ids, cache_salt))

    def _computed(self, chain: list[bytes], ids: list[int], out_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The prompt's chain extended over the full blocks whose KV exists: the last sampled
        token was never fed back."""
        return extend_chain(list(chain), ids + out_ids[:-1], self.block_size, cache_salt)

    async def _pull(self, ids: list[int], hashes: list[bytes], cache_salt: str | None) -> None:
        if len(hashes) < self.min_blocks:
            return
        start, peer = time.monotonic(), None
        try:
            found = await asyncio.wait_for(self.directory.locate(self.replica, hashes, self.min_blocks), self.timeout_s)
            if found is None:
                return
            peer, peer_engine, _ = found
            # A peer whose workers are where this engine's are leases its blocks to copy straight out.
            export = peer_engine.export_kv.remote(ids, cache_salt, 0, 0.0, await self.engine.kv_places())
            release = peer_engine.release_kv.remote  # a lease, where the peer shares its cache with this one
            move = move_kv(export, self.engine.import_kv, self.transfer, release)
            log.info("pulled %d blocks of KV from replica %s", await asyncio.wait_for(move, self.timeout_s), peer)
        except Exception as e:  # the request goes on and recomputes the prefix
            self.transfer.num_fallbacks += 1
            log.warning("KV pull from replica %s failed, recomputing: %s: %s", peer, type(e).__name__, e)
            if isinstance(e, RayActorError) and peer is not None:  # its engine is gone: no one asks it again
                await self.directory.forget(peer)
        self.transfer.seconds += time.monotonic() - start

    async def _publish(self, hashes: list[bytes]) -> None:
        if not hashes:
            return
        engine = self.engine
        publish = self.directory.publish(self.replica, engine.num_engine_restarts, engine.engine, hashes)
        try:
            await asyncio.wait_for(publish, self.timeout_s)
        except Exception as e:  # a missed publication only makes this KV harder to find
            log.warning("publishing KV blocks to the directory failed: %s: %s", type(e).__name__, e)

    def _publish_later(self, hashes: list[bytes]) -> None:
        task = asyncio.ensure_future(self._publish(hashes))
        self._tasks.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def hand_over(self) -> int:
        """Before this replica stops (Serve's graceful shutdown calls the deployment's __del__,
        after in-flight requests end): its pinned conversations' blocks into the prefix cache
        of the replica holding fewest (a replica just started, in a rolling update), with the
        blocks other draining replicas handed it, and the directory told, so their next turns
        start from KV there. Blocking (the destructor is synchronous); each call bounded by the
        pull timeout. Returns the blocks imported; 0 when no replica is left or anything failed."""
        directory, bound = self.directory.actor, self.timeout_s
        try:
            # First out of the directory: no one pulls from, or hands over to, a replica leaving.
            received = ray.get(directory.forget.remote(self.replica), timeout=bound)
            handoff, refs = ray.get(self.engine.engine.export_pinned.remote(received), timeout=bound)
            others = self._survivors(HAND_OVER_WAIT_S) if handoff.block_hashes else []
            if not others:
                return 0
            target, engine = others[0]
            done = ray.get(engine.import_kv.remote(handoff, refs), timeout=bound)
            ray.get(directory.hand_over.remote(self.replica, target, handoff.block_hashes), timeout=bound)
        except Exception as e:  # the conversations recompute where they land
            log.warning("handing pinned KV over failed: %s: %s", type(e).__name__, e)
            return 0
        log.info("handed %d pinned KV blocks over to replica %s", done.num_imported, target)
        return done.num_imported

    def _survivors(self, wait_s: float) -> list[tuple[str, Any]]:
        """The other replicas, waiting up to wait_s for one to start (a rolling update may
        stop the last old replica before its replacement has started)."""
        deadline = time.monotonic() + wait_s
        while not (others := ray.get(self.directory.actor.others.remote(self.replica), timeout=self.timeout_s)):
            if time.monotonic() >= deadline:
                return []
            time.sleep(0.2)
        return others

    async def stats(self) -> ServingStats:
        stats = await self.engine.stats()
        stats.kv_transfer = self.transfer
        return stats
