"""Block pool and KV cache manager scenarios with exact block ids and eviction order."""

from __future__ import annotations

import pytest
from cadenza_testkit.tiny_models import POOL_MODEL

from cadenza.actors.block_pool import BlockPool
from cadenza.actors.engine_core import kv_bytes_per_block, num_kv_blocks
from cadenza.actors.kv_cache_manager import KVCacheManager, hash_block
from cadenza.actors.request import Request
from cadenza.config import EngineConfig
from cadenza.messages import EngineRequest
from cadenza.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    req = EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(), cache_salt=salt)
    return Request(req, (), 0)


def compute(kv: KVCacheManager, req: Request) -> None:
    """Pretend the whole prompt was computed, as the scheduler's update would record."""
    req.num_computed_tokens = req.num_tokens
    kv.publish(req)


def test_allocate_release_lru_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert [x.block_id for x in a + b] == [0, 1, 2, 3]
    pool.release(b[::-1])  # tail first, as requests free
    pool.release(a[::-1])
    assert list(pool.free) == [4, 5, 3, 2, 1, 0]
    pool.check_invariants()


def test_prefix_hit_and_eviction_order() -> None:
    kv = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate(first, 10) == [0, 1, 2]
    compute(kv, first)
    kv.forget(first)
    assert list(kv.pool.free)[-3:] == [2, 1, 0]  # the prefix head is evicted last

    second = make_request("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached(second)
    assert [b.block_id for b in hits] == [0, 1]
    assert kv.allocate(second, 3, hits) == [0, 1, 2]  # block 2 was used and holds no hash: reused first
    kv.record_lookup(second, 8)
    stats = kv.pool.stats()
    assert (stats.queries, stats.hits) == (11, 8)
    kv.pool.check_invariants()


def test_last_token_is_never_a_hit() -> None:
    kv = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(8)))
    kv.allocate(req, 8)
    compute(kv, req)
    again = make_request("b", list(range(8)))
    assert len(kv.find_cached(again)) == 1  # 8 tokens = 2 blocks, but the last token must run


def test_salt_and_disabled_cache_do_not_share() -> None:
    kv = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(9)))
    kv.allocate(req, 9)
    compute(kv, req)
    assert kv.find_cached(make_request("b", list(range(9)), salt="tenant-2")) == []
    kv.enable_prefix_caching = False
    assert kv.find_cached(make_request("c", list(range(9)))) == []


def test_allocation_evicts_cached_blocks_when_pool_is_short() -> None:
    kv = KVCacheManager(BlockPool(3), block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8)
    compute(kv, a)
    kv.forget(a)
    b = make_request("b", [50 + i for i in range(12)])
    assert kv.allocate(b, 12) == [2, 1, 0]
    assert kv.pool.stats().evictions == 2 and not kv.pool.cached
    assert kv.allocate(make_request("c", [1]), 1) is None
    kv.pool.check_invariants()


def test_hash_is_chained() -> None:
    h1 = hash_block(None, [1, 2], ())
    assert hash_block(h1, [3, 4], ()) != hash_block(hash_block(None, [9, 9], ()), [3, 4], ())
    assert hash_block(None, [1, 2], ("salt",)) != h1


def test_double_release_is_caught() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(AssertionError):
        pool.release([block])


def test_churn_with_a_small_working_set_touches_few_blocks() -> None:
    """Two requests at a time, hundreds of times over: the pool reuses the blocks it has
    touched instead of cycling through (and paging in) all of them."""
    pool = BlockPool(64)
    for _ in range(200):
        a, b = pool.allocate(3), pool.allocate(2)
        pool.release(a[::-1])
        pool.release(b[::-1])
        pool.check_invariants()
    assert pool.num_touched == 5
    assert pool.stats().num_touched_blocks == 5


def test_with_caching_off_finished_requests_reuse_their_blocks() -> None:
    """Prefix caching off (peers' served workload): blocks still carry hashes while a prompt's
    siblings may share them, but a freed one drops its hash, so the next requests reuse it
    instead of touching (and paging in) fresh blocks until the whole pool is resident."""
    kv = KVCacheManager(BlockPool(64), block_size=4, enable_prefix_caching=False)
    for i in range(50):
        req = make_request(f"r{i}", [100 * i + t for t in range(12)])
        kv.allocate(req, 12)
        compute(kv, req)
        kv.forget(req)
        kv.pool.check_invariants()
    assert kv.pool.num_touched == 3 and kv.pool.stats().evictions == 0


def test_reuse_is_most_recently_freed_first() -> None:
    pool = BlockPool(8)
    a, b, c = pool.allocate(1), pool.allocate(1), pool.allocate(1)
    pool.release(a)
    pool.release(c)
    pool.release(b)
    assert [x.block_id for x in pool.allocate(3)] == [1, 2, 0]


def test_cached_blocks_are_kept_while_untouched_blocks_are_free() -> None:
    kv = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))
    assert kv.allocate(first, 8) == [0, 1]
    compute(kv, first)
    kv.forget(first)
    other = make_request("b", [50 + i for i in range(16)])
    assert kv.allocate(other, 16) == [2, 3, 4, 5]  # never-used blocks, not the cached 0 and 1
    assert kv.pool.stats().evictions == 0
    assert [b.block_id for b in kv.find_cached(make_request("c", list(range(8)) + [7]))] == [0, 1]
    kv.pool.check_invariants()


def test_uncached_used_blocks_go_before_untouched_and_cached_ones() -> None:
    pool = BlockPool(6)
    held = pool.allocate(3)
    pool.cache(held[0], b"h0")
    pool.release(held)  # 0 cached, 1 and 2 plain
    assert [b.block_id for b in pool.allocate(2)] == [2, 1]  # warm, most recently freed first
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 5]  # then the never-used
    assert pool.lookup(b"h0") is held[0] and pool.evictions == 0
    assert [b.block_id for b in pool.allocate(1)] == [0] and pool.evictions == 1  # evicted last
    pool.check_invariants()


def test_eviction_among_cached_blocks_is_lru() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for block in blocks:
        pool.cache(block, f"h{block.block_id}".encode())
    for block in (blocks[2], blocks[0], blocks[3], blocks[1]):
        pool.release([block])
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]  # least recently freed first
    assert pool.lookup(b"h3") is blocks[3] and pool.lookup(b"h1") is blocks[1]
    assert pool.lookup(b"h2") is None and pool.evictions == 2
    pool.check_invariants()


def test_reset_cache_makes_cached_blocks_reusable_first() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], b"h0")
    pool.release(blocks[::-1])
    pool.reset_cache()
    pool.check_invariants()
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]  # warm (last freed first), then new


TINY = POOL_MODEL


def test_pool_size_is_the_demand_capped_by_kv_cache_memory() -> None:
    block_bytes = kv_bytes_per_block(TINY, 16, 4)  # fp32: 2 x 2 layers x 16 tokens x 2 heads x 16 dims x 4 B
    assert block_bytes == 8192
    roomy = EngineConfig(model="m", dtype="float32", kv_cache_memory=1000 * block_bytes, max_num_seqs=4)
    assert num_kv_blocks(roomy, TINY, 100) == 4 * 7  # 100 tokens: 7 blocks of 16 per sequence
    assert num_kv_blocks(roomy, TINY, 112) == 4 * 7  # exactly 7 blocks
    tight = EngineConfig(model="m", dtype="float32", kv_cache_memory=10 * block_bytes + 5, max_num_seqs=4)
    assert num_kv_blocks(tight, TINY, 100) == 10  # memory caps the demand
    tiny = EngineConfig(model="m", dtype="float32", kv_cache_memory=100, max_num_seqs=4)
    assert num_kv_blocks(tiny, TINY, 100) == 1  # never an empty pool
    given = EngineConfig(model="m", dtype="float32", num_blocks=3, kv_cache_memory=1000 * block_bytes)
    assert num_kv_blocks(given, TINY, 100) == 3  # num_blocks wins over both
