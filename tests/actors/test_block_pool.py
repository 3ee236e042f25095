"""Block pool and KV cache manager scenarios with exact block ids and eviction order."""

from __future__ import annotations

import pytest

from cadenza.actors.block_pool import BlockPool
from cadenza.actors.kv_cache_manager import KVCacheManager, hash_block
from cadenza.actors.request import Request
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
    assert kv.allocate(second, 3, hits) == [0, 1, 3]
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
