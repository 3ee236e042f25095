"""An engine's side of the KV connector: export the cached blocks of a prompt's prefix, import
another engine's into this pool's prefix cache. Blocks move by the prefix cache's hash chain
(kv_cache_manager.hash_block), so an import files each block where the scheduler's lookup for
the same tokens (and cache salt) finds it: the request that follows computes only the rest.
Exported blocks are held (a reference each) while their bytes are read, so no eviction can
reuse them mid-read; imported ones are held while written, then filed as cached and free.

An export may skip the run's first blocks (sent already) and wait for the run to grow: the
scheduler caches a prompt's full blocks after every step, so a prompt prefilled in chunks is
handed over chunk by chunk while the later chunks compute (actors/disaggregated.py).

For an importer whose workers are where this engine's are (`pull_at`: each worker's place, the
node and on CUDA the GPU), when both share their caches (the `ipc` transport,
shared_cache.py), an export reads nothing: it leases the blocks (held until the
mover releases them, or for lease_s at most) and names them; the importer's workers copy them
straight out of this engine's caches."""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import suppress
from typing import Any

from cadenza.actors.block_pool import KVBlock
from cadenza.actors.kv_cache_manager import KVCacheManager, extend_chain
from cadenza.actors.kv_connector.handoff import KVHandoff, KVImport, KVPull, KVShare


def prefix_hashes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """The chain of hashes of token_ids' full blocks, as the scheduler keys them."""
    return extend_chain([], token_ids, block_size, cache_salt)


def _hashes(blocks: list[KVBlock]) -> list[bytes]:
    hashes = [b.block_hash for b in blocks]
    assert all(h is not None for h in hashes), "exported a block the prefix cache does not name"
    return hashes


class EnginePort:
    def __init__(self, kv: KVCacheManager, executor: Any, lease_s: float = 10.0, shared: bool = False) -> None:  # noqa: ANN401, E501 - a WorkerExecutor with read_kv / write_kv
        # shared: the workers' caches are shareable (kv_transport "ipc" or "nixl"), so peers may pull.
        self.kv, self.executor, self.lease_s, self.shared = kv, executor, lease_s, shared
        self.exported_blocks = self.imported_blocks = self.skipped_blocks = 0
        self.bytes_in = 0  # counted where written: an exporter's arrays may never be fetched
        self._stepped = asyncio.Event()  # set (and replaced) after every step of the engine
        self._leases: dict[int, tuple[list[KVBlock], float]] = {}  # lease -> blocks held, expires_at
        self._lease_ids = itertools.count()
        self._known_shares: list[list[KVShare]] | None = None
        self._workers_built = 0  # counts drop_leases: the workers' rebuilds

    def step_done(self) -> None:
        """The engine finished a step: it may have cached more of a prompt's blocks."""
        self._stepped.set()
        self._stepped = asyncio.Event()
        self._expire_leases()

    async def places(self) -> list[str] | None:
        """Where each worker is (runner_setup.kv_place), as an exporter's pull_at; None where
        the caches are private."""
        shares = await self._shares()
        return None if shares is None else [worker[0].place for worker in shares]

    def release(self, lease: int) -> None:
        """A pull of leased blocks is over (copied or not): they may be evicted again."""
        if (held := self._leases.pop(lease, None)) is not None:
            self.kv.pool.release(held[0][::-1])
        self._expire_leases()

    def _expire_leases(self, now: float | None = None) -> None:
        """Release the leases past their end (their mover is gone, or far too slow: its importer
        discards a copy that ended after expires_at); with now=inf, all of them. Called after
        every step: nothing to do without leases."""
        if not self._leases:
            return
        now = time.monotonic() if now is None else now
        for lease in [n for n, (_, end) in self._leases.items() if end <= now]:
            self.kv.pool.release(self._leases.pop(lease)[0][::-1])

    def drop_leases(self) -> None:
        """The workers' KV is lost (they are being rebuilt): no lease holds a block any more,
        and the new workers' caches are shared anew. A pull under way still copies consistent
        KV: a dead CPU worker's memfd lives while mapped."""
        self._expire_leases(float("inf"))
        self._known_shares, self._workers_built = None, self._workers_built + 1

    async def _shares(self) -> list[list[KVShare]] | None:
        """The workers' shares, None where not shared. Asked until every worker answers, then
        kept: they change only when the workers are rebuilt (an answer from the workers before
        a rebuild is not kept)."""
        if not self.shared or self._known_shares is not None:
            return self._known_shares
        built = self._workers_built
        shares = await self.executor.kv_shares()
        if shares and built == self._workers_built:
            self._known_shares = shares
        return shares

    async def export(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        skip: int = 0,
        wait_s: float = 0.0,
        pull_at: list[str] | None = None,
    ) -> tuple[KVHandoff, list[Any]]:
        """The leading run of token_ids' full blocks this pool caches, after its first `skip`
        blocks, and their bytes (one object-store reference per worker), or for an importer
        whose worker i is where this engine's worker i is (pull_at, its places()), a lease on
        them (KVHandoff.pull).
        With wait_s, first wait (that long at most) until the run is longer than `skip`: the
        prompt's prefill is still caching its blocks, step by step."""
        hashes = prefix_hashes(token_ids, self.kv.block_size, cache_salt)
        deadline = asyncio.get_running_loop().time() + wait_s
        while len(run := self.kv.pool.cached_run(hashes)) <= skip < len(hashes):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), left)
        return await self._export(run[skip:], pull_at)

    def _lease(self, blocks: list[KVBlock], shares: list[list[KVShare]]) -> KVHandoff:
        """Held blocks kept held for a peer to copy out of this engine's shared caches."""
        lease, expires_at, wall_end = next(self._lease_ids), time.monotonic() + self.lease_s, time.time() + self.lease_s
        self._leases[lease] = (blocks, expires_at)
        # Ends it even on an engine that steps no more (its mover gone: cancelled mid-export).
        asyncio.get_running_loop().call_later(self.lease_s, self._expire_leases)
        self.exported_blocks += len(blocks)
        ids = [b.block_id for b in blocks]
        pull = KVPull(lease=lease, block_ids=ids, shares=shares, expires_at=expires_at, wall_expires_at=wall_end)
        return KVHandoff(block_hashes=_hashes(blocks), block_size=self.kv.block_size, pull=pull)

    async def export_pinned(self, also: list[bytes]) -> tuple[KVHandoff, list[Any]]:
        """Every block session pins hold, and those of the hashes `also` still cached (what
        other engines handed this one): a draining engine hands its conversations over."""
        blocks = {b.block_id: b for b in self.kv.pins.pinned_blocks()}
        for block_hash in also:
            if (block := self.kv.pool.lookup(block_hash)) is not None:
                blocks.setdefault(block.block_id, block)
        return await self._export(list(blocks.values()))

    async def _export(self, blocks: list[KVBlock], pull_at: list[str] | None = None) -> tuple[KVHandoff, list[Any]]:
        """Cached blocks' hashes and bytes, held while read so no eviction reuses them (or
        leased, for a pull by workers at pull_at)."""
        pool, size = self.kv.pool, self.kv.block_size
        if not blocks:
            return KVHandoff(block_hashes=[], block_size=size), []
        pool.touch(blocks)  # before any await: no eviction may reuse them from here
        leased = False
        try:
            if pull_at is not None and (shares := await self._shares_at(pull_at)) is not None:
                handoff, leased = self._lease(blocks, shares), True  # the lease keeps them held
                return handoff, []
            refs = await self.executor.read_kv([b.block_id for b in blocks])
        finally:
            if not leased:
                pool.release(blocks[::-1])
        self.exported_blocks += len(blocks)
        return KVHandoff(block_hashes=_hashes(blocks), block_size=size), refs

    async def _shares_at(self, pull_at: list[str]) -> list[list[KVShare]] | None:
        """The workers' shares when the importer's worker i can read worker i's: it is in the
        same place, or the shares name NIXL agents (any place); else None."""
        shares = await self._shares()
        if shares is None or len(shares) != len(pull_at):
            return None
        pairs = zip(shares, pull_at, strict=True)
        return shares if all(s.nixl_agent or s.place == place for worker, place in pairs for s in worker) else None

    async def import_(self, handoff: KVHandoff, refs: list[Any]) -> KVImport:
        """File the handoff's blocks this pool lacks (those it holds are skipped), as far as
        free blocks allow; what is not imported is simply recomputed by the request."""
        pool = self.kv.pool
        if handoff.block_size != self.kv.block_size:
            raise ValueError(f"block_size {handoff.block_size} != this engine's {self.kv.block_size}")
        found = [pool.lookup(h) for h in handoff.block_hashes]
        held = [b for b in found if b is not None]
        pool.touch(held)  # so allocating below cannot evict a block this handoff would skip
        missing = [i for i, b in enumerate(found) if b is None][: pool.num_free_blocks]
        blocks = pool.allocate(len(missing))
        try:
            num_bytes = 0
            if blocks and handoff.pull is not None:
                num_bytes = await self.executor.pull_kv([b.block_id for b in blocks], handoff.pull, missing)
            elif blocks:
                num_bytes = await self.executor.write_kv([b.block_id for b in blocks], refs, missing)
            for i, block in zip(missing, blocks, strict=True):
                pool.cache(block, handoff.block_hashes[i])
        finally:
            pool.release([*blocks, *held][::-1])
        skipped = len(held)
        self.imported_blocks += len(blocks)
        self.skipped_blocks += skipped
        self.bytes_in += num_bytes
        return KVImport(num_imported=len(blocks), num_skipped=skipped, num_bytes=num_bytes)
