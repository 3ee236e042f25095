"""KV block pool: fixed-size blocks, reference counts, an LRU free queue and a prefix cache.

A freed block keeps its hash until it is handed out again, so a later request with the same
prefix finds it; the free queue's order decides which cached block is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
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
        # NOTE: ordered least- to most-recently freed; allocation takes from the front.
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.queries = self.hits = self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[KVBlock]:
        """n blocks from the free queue's front, evicting their cached hashes."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        blocks = [self.free.popitem(last=False)[1] for _ in range(n)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on (cached) blocks, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue's back in the given order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} released more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full, computed block under its hash; a duplicate of a cached one stays private."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_cache(self) -> None:
        """Forget every cached hash: the KV those blocks held is gone (the workers were rebuilt),
        so a later lookup must miss rather than serve zeroed or stale KV."""
        assert not any(b.ref_cnt for b in self.blocks), "reset_cache with blocks still referenced"
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        block.block_hash = None
        self.evictions += 1

    def stats(self) -> BlockPoolStats:
        used = self.num_blocks - self.num_free_blocks
        return BlockPoolStats(
            self.num_blocks, self.num_free_blocks, used / self.num_blocks, self.queries, self.hits, self.evictions
        )

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in self.free), f"block {block.block_id} free-list mismatch"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
        assert all(b.block_hash == h for h, b in self.cached.items()), "cache index points at a rehashed block"
