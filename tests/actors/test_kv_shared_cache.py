"""The `ipc` KV transport's pieces (actors/kv_connector/shared_cache.py, engine_port.py): a
shared cache set opened by another process gives the exporter's blocks byte for byte; a share
from another node, or one whose memfd is gone, is refused; a copy that ends after its lease is
discarded; an exporter's leases hold their blocks until released or expired."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from cadenza.actors.block_pool import BlockPool
from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.kv_connector.engine_port import EnginePort, prefix_hashes
from cadenza.actors.kv_connector.handoff import KVShare
from cadenza.actors.kv_connector.shared_cache import (
    KVLeaseExpired,
    KVShareGone,
    PeerCaches,
    allocate_shared,
    check_lease,
    pull_blocks,
)

SHAPE = (3, 2, 8, 4, 2, 5)  # layers, K/V, blocks, block_size, kv_heads, head_dim


def _filled(dtype: torch.dtype = torch.float32) -> tuple[list, KVShare]:  # noqa: ANN001
    caches = allocate_shared(SHAPE, dtype, torch.device("cpu"), "node-a")
    for layer, (k, v) in enumerate(caches):
        k.copy_(torch.randn(k.shape).to(dtype) + layer)
        v.copy_(torch.randn(v.shape).to(dtype) - layer)
    return caches, caches.share


def _private(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(SHAPE[2:], dtype=dtype), torch.zeros(SHAPE[2:], dtype=dtype)) for _ in range(SHAPE[0])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_peer_copies_the_exporters_blocks_exactly(dtype: torch.dtype) -> None:
    caches, share = _filled(dtype)
    mine = _private(dtype)
    done = pull_blocks(mine, [6, 1], PeerCaches("node-a").tensor(share), [2, 5])
    assert done == 2 * SHAPE[0] * 2 * mine[0][0][0].numel() * mine[0][0].element_size()
    for (k, v), (pk, pv) in zip(mine, caches, strict=True):
        assert torch.equal(k[6], pk[2]) and torch.equal(v[1], pv[5])
        assert not k[0].any() and not v[2].any()  # only the named blocks were written


@pytest.mark.parametrize(
    ("here", "there"),
    [([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]),  # no runs: by index
     ([4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]),  # two runs of 4: by slices
     ([2, 3, 4, 5, 6, 7, 0], [1, 2, 3, 4, 5, 6, 0])],  # a run of 6 and one of 1
)  # fmt: skip
def test_a_pull_by_runs_or_by_index_copies_the_same(here: list[int], there: list[int]) -> None:
    caches, share = _filled()
    mine = _private()
    pull_blocks(mine, here, PeerCaches("node-a").tensor(share), there)
    for (k, v), (pk, pv) in zip(mine, caches, strict=True):
        for to, start in zip(here, there, strict=True):
            assert torch.equal(k[to], pk[start]) and torch.equal(v[to], pv[start])


def test_another_process_opens_the_share_and_reads_the_same_bytes() -> None:
    """The real case: the importer is another process (it opens /proc/<pid>/fd/<fd>)."""
    caches, share = _filled()
    child = """
import sys, msgspec, torch
from cadenza.actors.kv_connector.handoff import KVShare
from cadenza.actors.kv_connector.shared_cache import PeerCaches
share = msgspec.json.decode(sys.stdin.buffer.read(), type=KVShare)
t = PeerCaches("node-a").tensor(share)
print(float(t[:, :, 3].double().sum()), float(t[1, 1, 7].double().sum()))
"""
    run = subprocess.run(
        [sys.executable, "-c", child], input=msgspec.json.encode(share), capture_output=True, check=True, timeout=120
    )
    got = [float(x) for x in run.stdout.split()]
    want = [float(caches.base[:, :, 3].double().sum()), float(caches[1][1][7].double().sum())]
    assert got == pytest.approx(want, rel=1e-12)


def test_a_share_from_another_node_or_a_gone_memfd_is_refused() -> None:
    _, share = _filled()
    with pytest.raises(KVShareGone, match="opens at node-a, not here"):
        PeerCaches("node-b").tensor(share)
    with pytest.raises(KVShareGone, match="no longer the KV share"):  # the fd is there, but not this memfd
        PeerCaches("node-a").tensor(msgspec.structs.replace(share, name="cadenza-kv-other"))
    with pytest.raises(KVShareGone, match="is gone"):
        PeerCaches("node-a").tensor(msgspec.structs.replace(share, fd=10_000))


def test_a_peer_forgets_a_share_whose_memfd_is_closed() -> None:
    peers = PeerCaches("node-a")
    first, share = _filled()
    peers.tensor(share)
    del first  # its memfd is closed, as if its process had exited
    gc.collect()
    _, other = _filled()
    peers.tensor(other)
    assert list(peers._open) == [other.name]


def test_a_dropped_cache_set_closes_its_memfd() -> None:
    """An engine that rebuilds its worker in-process frees the old cache's memory."""
    caches, share = _filled()
    path = f"/proc/{os.getpid()}/fd/{share.fd}"
    assert os.readlink(path) == f"/memfd:{share.name} (deleted)"
    del caches
    gc.collect()
    assert not os.path.exists(path) or os.readlink(path) != f"/memfd:{share.name} (deleted)"


def test_a_copy_that_ends_after_its_lease_is_refused() -> None:
    check_lease(time.monotonic() + 60, 0.0, same_node=True)  # one node: its monotonic clock decides
    with pytest.raises(KVLeaseExpired):
        check_lease(time.monotonic(), time.time() + 60, same_node=True)


class _SharedExecutor:
    """An executor whose one worker's caches are shared on node-a (what EnginePort asks of it)."""

    async def kv_shares(self) -> list[list[KVShare]]:
        return [[_filled()[1]]]

    async def read_kv(self, block_ids: list[int]) -> list[object]:
        return ["bytes"]


def _port_with_cached_prompt(lease_s: float) -> tuple[EnginePort, list[int]]:
    kv = KVCacheManager(BlockPool(8), 4, True)
    prompt = list(range(12))  # 3 full blocks
    blocks = kv.pool.allocate(3)
    for block, block_hash in zip(blocks, prefix_hashes(prompt, 4, None), strict=True):
        kv.pool.cache(block, block_hash)
    kv.pool.release(blocks)
    return EnginePort(kv, _SharedExecutor(), lease_s, shared=True), prompt


def test_a_lease_holds_its_blocks_until_released() -> None:
    port, prompt = _port_with_cached_prompt(lease_s=60)
    handoff, refs = asyncio.run(port.export(prompt, None, pull_at=["node-a"]))
    assert refs == [] and handoff.pull is not None and len(handoff.pull.block_ids) == 3
    assert port.kv.pool.num_free_blocks == 5  # held: no allocation may evict them
    port.release(handoff.pull.lease)
    assert port.kv.pool.num_free_blocks == 8
    port.release(handoff.pull.lease)  # twice: nothing more happens
    assert port.kv.pool.num_free_blocks == 8


def test_a_lease_nobody_releases_ends_on_its_own() -> None:
    port, prompt = _port_with_cached_prompt(lease_s=0.05)
    handoff, _ = asyncio.run(port.export(prompt, None, pull_at=["node-a"]))
    assert port.kv.pool.num_free_blocks == 5
    time.sleep(0.1)
    port.step_done()  # leases are checked after every step
    assert port.kv.pool.num_free_blocks == 8

    async def idle_engine() -> int:  # no step, no call: the lease's timer ends it
        await port.export(prompt, None, pull_at=["node-a"])
        held = port.kv.pool.num_free_blocks
        await asyncio.sleep(0.2)
        return held

    assert asyncio.run(idle_engine()) == 5 and port.kv.pool.num_free_blocks == 8


def test_an_importer_on_another_node_gets_the_bytes_instead() -> None:
    port, prompt = _port_with_cached_prompt(lease_s=60)
    for elsewhere in (["node-b"], ["node-a", "node-a"]):  # another place; another worker count
        handoff, refs = asyncio.run(port.export(prompt, None, pull_at=elsewhere))
        assert handoff.pull is None and refs == ["bytes"] and port.kv.pool.num_free_blocks == 8
