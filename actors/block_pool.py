"""KV block pool: fixed-size blocks, reference counts, a free queue and a prefix cache.

A freed block keeps its hash until it is handed out again, so a later request with the same
prefix finds it. Allocation prefers, in order:
  1. a free block that was used before and holds no hash, the most recently freed first: its
     KV pages are already resident (and likely warm in cache);
  2. a never-used block, in id order: its KV memory may never have been touched (the workers
     allocate the pool lazily-backed), so handing these out only on demand keeps the
     process's resident memory to what the load really needs;
  3. the least recently freed cached block, whose hash is evicted (the prefix cache's LRU).
So a cached block is only evicted when no uncached or untouched block is free, and the
touched part of the pool grows only with the number of blocks in use at once, never with
churn (a plain LRU queue would cycle through, and touch, every block). With prefix caching
off, a block drops its hash when its last holder frees it (release's keep_cached), so it joins
the reusable blocks rather than waiting, cached for no one, while fresh ones are touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cadenza.stats import BlockPoolStats


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Every free block, least- to most-recently freed (the never-used ones first, in id
        # order): once only cached blocks are free, the front is the one to evict.
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # The free blocks that were used before and hold no hash, in the same order; reused
        # from the back (the warmest).
        self.warm: OrderedDict[int, KVBlock] = OrderedDict()
        # Blocks [0, num_touched) have been handed out at least once; the rest never were.
        # Never-used blocks go out in id order, so one counter is the whole record (and the
        # high-water mark of the pool's touched KV memory).
        self.num_touched = 0
        self.cached: dict[bytes, KVBlock] = {}
        self.queries = self.hits = self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[KVBlock]:
        """n free blocks in the order of preference above, evicting any cached hashes."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        blocks = [self._take_free() for _ in range(n)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _take_free(self) -> KVBlock:
        if self.warm:
            block_id, block = self.warm.popitem(last=True)
            del self.free[block_id]
            return block
        if self.num_touched < self.num_blocks:
            block = self.blocks[self.num_touched]
            self.num_touched += 1
            del self.free[block.block_id]
            return block
        return self.free.popitem(last=False)[1]  # every free block is cached: the LRU one

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on (cached) blocks, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                # Only a cached block can be found while free: a never-used one taken here
                # would be handed out a second time by allocate's id-order counter.
                assert block.block_hash is not None, f"touched free block {block.block_id} holds no hash"
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock], keep_cached: bool = True) -> None:
        """Drop one reference each; blocks reaching zero join the queue's back in the given order.
        keep_cached=False forgets the hash of a block no one holds any more (prefix caching off:
        a hash lives only while siblings of one prompt share it), so the block is reused first
        rather than kept while never-used blocks are touched."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} released more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block
                if not keep_cached and block.block_hash is not None:
                    self._unhash(block)  # not an eviction: nothing was cached for later
                if block.block_hash is None:
                    self.warm[block.block_id] = block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cached_run(self, hashes: Sequence[bytes]) -> list[KVBlock]:
        """The blocks of the longest leading run of `hashes` this pool caches."""
        blocks: list[KVBlock] = []
        for block_hash in hashes:
            if (block := self.cached.get(block_hash)) is None:
                break
            blocks.append(block)
        return blocks

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full, computed block under its hash; a duplicate of a cached one stays private."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.warm.pop(block.block_id, None)  # blocks are published while held; never mind if not

    def reset_cache(self) -> None:
        """Forget every cached hash: the KV those blocks held is gone (the workers were rebuilt),
        so a later lookup must miss rather than serve zeroed or stale KV."""
        assert not any(b.ref_cnt for b in self.blocks), "reset_cache with blocks still referenced"
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        # Every used block is now free and hashless: reusable first, in the queue's order.
        self.warm = OrderedDict((bid, b) for bid, b in self.free.items() if bid < self.num_touched)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        self._unhash(block)
        self.evictions += 1

    def _unhash(self, block: KVBlock) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None

    def stats(self) -> BlockPoolStats:
        used = self.num_blocks - self.num_free_blocks
        return BlockPoolStats(
            self.num_blocks,
            self.num_free_blocks,
            used / self.num_blocks,
            self.queries,
            self.hits,
            self.evictions,
            self.num_touched,
        )

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in self.free), f"block {block.block_id} free-list mismatch"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
            if block.block_id >= self.num_touched:
                assert block.ref_cnt == 0 and block.block_hash is None, f"never-used block {block.block_id} in use"
        assert all(b.block_hash == h for h, b in self.cached.items()), "cache index points at a rehashed block"
        warm = [bid for bid, b in self.free.items() if bid < self.num_touched and b.block_hash is None]
        assert list(self.warm) == warm, "the reusable list is not the used, hashless free blocks in queue order"
