"""An engine's side of the KV connector: export the cached blocks of a prompt's prefix, import
another engine's into this pool's prefix cache. Blocks move by the prefix cache's hash chain
(kv_cache_manager.hash_block), so an import files each block where the scheduler's lookup for
the same tokens (and cache salt) finds it: the request that follows computes only the rest.
Exported blocks are held (a reference each) while their bytes are read, so no eviction can
reuse them mid-read; imported ones are held while written, then filed as cached and free.

An export may skip the run's first blocks (sent already) and wait for the run to grow: the
scheduler caches a prompt's full blocks after every step, so a prompt prefilled in chunks is
handed over chunk by chunk while the later chunks compute (actors/disaggregated.py)."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Any

from cadenza.actors.block_pool import KVBlock
from cadenza.actors.kv_cache_manager import KVCacheManager, extend_chain
from cadenza.actors.kv_connector.handoff import KVHandoff, KVImport


def prefix_hashes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """The chain of hashes of token_ids' full blocks, as the scheduler keys them."""
    return extend_chain([], token_ids, block_size, cache_salt)


class EnginePort:
    def __init__(self, kv: KVCacheManager, executor: Any) -> None:  # noqa: ANN401 - a WorkerExecutor with read_kv / write_kv
        self.kv, self.executor = kv, executor
        self.exported_blocks = self.imported_blocks = self.skipped_blocks = 0
        self.bytes_in = 0  # counted where written: an exporter's arrays may never be fetched
        self._stepped = asyncio.Event()  # set (and replaced) after every step of the engine

    def step_done(self) -> None:
        """The engine finished a step: it may have cached more of a prompt's blocks."""
        self._stepped.set()
        self._stepped = asyncio.Event()

    async def export(
        self, token_ids: list[int], cache_salt: str | None, skip: int = 0, wait_s: float = 0.0
    ) -> tuple[KVHandoff, list[Any]]:
        """The leading run of token_ids' full blocks this pool caches, after its first `skip`
        blocks, and their bytes (one object-store reference per worker). With wait_s, first
        wait (that long at most) until the run is longer than `skip`: the prompt's prefill is
        still caching its blocks, step by step."""
        hashes = prefix_hashes(token_ids, self.kv.block_size, cache_salt)
        deadline = asyncio.get_running_loop().time() + wait_s
        while len(run := self.kv.pool.cached_run(hashes)) <= skip < len(hashes):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), left)
        return await self._export(run[skip:])

    async def export_pinned(self, also: list[bytes]) -> tuple[KVHandoff, list[Any]]:
        """Every block session pins hold, and those of the hashes `also` still cached (what
        other engines handed this one): a draining engine hands its conversations over."""
        blocks = {b.block_id: b for b in self.kv.pins.pinned_blocks()}
        for block_hash in also:
            if (block := self.kv.pool.lookup(block_hash)) is not None:
                blocks.setdefault(block.block_id, block)
        return await self._export(list(blocks.values()))

    async def _export(self, blocks: list[KVBlock]) -> tuple[KVHandoff, list[Any]]:
        """Cached blocks' hashes and bytes, held while read so no eviction reuses them."""
        pool, size = self.kv.pool, self.kv.block_size
        if not blocks:
            return KVHandoff(block_hashes=[], block_size=size), []
        pool.touch(blocks)
        try:
            refs = await self.executor.read_kv([b.block_id for b in blocks])
        finally:
            pool.release(blocks[::-1])
        self.exported_blocks += len(blocks)
        hashes = [b.block_hash for b in blocks]
        assert all(h is not None for h in hashes), "exported a block the prefix cache does not name"
        return KVHandoff(block_hashes=hashes, block_size=size), refs

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
            if blocks:
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
