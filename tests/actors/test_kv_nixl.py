"""The `nixl` KV transport (actors/kv_connector/nixl_transfer.py): a worker's NIXL agent reads a
peer's blocks byte for byte, in one read for every cache set, from this process or another; a
gone peer fails that read alone (KVShareGone: its request recomputes) and the agent reads
others still; an exporter leases to an importer in any place; a copy from another node is
checked against the lease's wall-clock end."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from cadenza.actors.kv_connector.handoff import KVShare
from cadenza.actors.kv_connector.nixl_transfer import NixlAgent
from cadenza.actors.kv_connector.shared_cache import (
    NODE_CLOCK_SKEW_S,
    KVLeaseExpired,
    KVShareGone,
    allocate_shared,
    check_lease,
)
from cadenza.config import EngineConfig

SHAPE = (3, 2, 8, 4, 2, 5)  # layers, K/V, blocks, block_size, kv_heads, head_dim
DRAFT = (2, 2, 8, 4, 1, 3)  # a draft model's set: other layers and heads, the same blocks


def _set(place: str, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE, fill: bool = True) -> list:
    caches = allocate_shared(shape, dtype, torch.device("cpu"), place)
    if fill:
        caches.base.copy_(torch.randn(shape).to(dtype))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("here", "there"),
    [([6, 1], [2, 5]),  # no runs
     ([4, 5, 6, 7, 0, 1], [0, 1, 2, 3, 6, 7])],  # runs: a descriptor per run, layer and K/V
)  # fmt: skip
def test_a_nixl_read_copies_the_exporters_blocks_exactly(dtype: torch.dtype, here: list[int], there: list[int]) -> None:
    theirs, mine = _set("node-a", dtype), _set("node-b", dtype, fill=False)
    exporter = NixlAgent([theirs])  # kept: its agent goes with it
    done = NixlAgent([mine]).pull(here, exporter.shares(), there)
    assert done == len(here) * 2 * SHAPE[0] * mine[0][0][0].numel() * mine[0][0].element_size()
    for (k, v), (pk, pv) in zip(mine, theirs, strict=True):
        for to, start in zip(here, there, strict=True):
            assert torch.equal(k[to], pk[start]) and torch.equal(v[to], pv[start])
        untouched = [b for b in range(SHAPE[2]) if b not in here]
        assert not k[untouched].any() and not v[untouched].any()


def test_a_models_and_a_drafts_sets_move_in_one_read() -> None:
    theirs, mine = (
        [_set("node-a"), _set("node-a", shape=DRAFT)],
        [_set("b", fill=False), _set("b", shape=DRAFT, fill=False)],
    )
    exporter = NixlAgent(theirs)
    shares = exporter.shares()
    assert len({s.nixl_agent for s in shares}) == 1 and shares[0].addr != shares[1].addr
    NixlAgent(mine).pull([0, 1, 2], shares, [3, 4, 5])
    for ours, peer in zip(mine, theirs, strict=True):
        assert torch.equal(ours.base[:, :, :3], peer.base[:, :, 3:6])


def test_a_share_that_does_not_fit_is_refused() -> None:
    exporter = NixlAgent([_set("node-a", torch.bfloat16)])
    shares = exporter.shares()
    with pytest.raises(ValueError, match="does not fit this cache"):
        NixlAgent([_set("node-b", fill=False)]).pull([0], shares, [0])


EXPORTER = """
import sys, msgspec, torch
from cadenza.actors.kv_connector.shared_cache import allocate_shared
from cadenza.actors.kv_connector.nixl_transfer import NixlAgent
torch.manual_seed(0)
caches = allocate_shared(%r, torch.float32, torch.device("cpu"), "node-a")
caches.base.copy_(torch.randn(caches.base.shape))
agent = NixlAgent([caches])
sys.stdout.buffer.write(b"SHARE " + msgspec.json.encode(agent.shares()[0]) + b"\\n")
sys.stdout.flush()
sys.stdin.readline()
"""


def _exporter() -> tuple[subprocess.Popen, KVShare]:
    """Another process sharing a seeded set through its agent (what an exporting worker is)."""
    child = subprocess.Popen([sys.executable, "-c", EXPORTER % (SHAPE,)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    while not (line := child.stdout.readline()).startswith(b"SHARE "):
        assert line, "the exporter exited before sharing its caches"
    return child, msgspec.json.decode(line.removeprefix(b"SHARE "), type=KVShare)


def test_another_process_is_read_and_its_exit_fails_the_next_read_alone() -> None:
    """The real case: the exporter is another process. When it is gone, a read of it fails
    (the request recomputes) and this agent still reads a live peer."""
    child, share = _exporter()
    mine = _set("node-b", fill=False)
    agent = NixlAgent([mine])
    try:
        agent.pull([0, 1, 2], [share], [5, 6, 7])
        torch.manual_seed(0)
        assert torch.equal(mine.base[:, :, :3], torch.randn(SHAPE)[:, :, 5:8])
    finally:
        child.communicate(b"\n", timeout=60)
    with pytest.raises(KVShareGone, match="NIXL read"):
        agent.pull([0, 1, 2], [share], [5, 6, 7])
    live = _set("node-c")
    exporter = NixlAgent([live])
    agent.pull([4], exporter.shares(), [1])
    assert torch.equal(mine.base[:, :, 4], live.base[:, :, 1])


def test_a_copy_from_another_node_ends_before_the_leases_wall_clock_end() -> None:
    far = time.monotonic() + 60
    check_lease(far, time.time() + 60, same_node=False)
    with pytest.raises(KVLeaseExpired):  # inside the clocks' allowed skew of its end
        check_lease(far, time.time() + NODE_CLOCK_SKEW_S / 2, same_node=False)
    with pytest.raises(KVLeaseExpired):  # on one node the monotonic clock decides
        check_lease(time.monotonic() - 1, time.time() + 60, same_node=True)


def test_an_exporter_leases_to_an_importer_anywhere_by_nixl() -> None:
    from cadenza.actors.block_pool import BlockPool
    from cadenza.actors.kv_cache_manager import KVCacheManager
    from cadenza.actors.kv_connector.engine_port import EnginePort, prefix_hashes

    shares = NixlAgent([_set("node-a")]).shares()

    class Executor:
        async def kv_shares(self) -> list[list[KVShare]]:
            return [shares]

    kv = KVCacheManager(BlockPool(8), 4, True)
    prompt = list(range(8))
    blocks = kv.pool.allocate(2)
    for block, block_hash in zip(blocks, prefix_hashes(prompt, 4, None), strict=True):
        kv.pool.cache(block, block_hash)
    kv.pool.release(blocks)
    port = EnginePort(kv, Executor(), 30.0, shared=True)
    handoff, refs = asyncio.run(port.export(prompt, None, pull_at=["node-b"]))  # another node
    assert refs == [] and handoff.pull is not None and handoff.pull.shares == [shares]
    assert handoff.pull.wall_expires_at == pytest.approx(time.time() + 30.0, abs=5)


def test_kv_transport_nixl_needs_nixl_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    assert EngineConfig(kv_transport="nixl").shares_kv
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install nixl"):
        EngineConfig(kv_transport="nixl")


IDLE = """
import time, torch
from cadenza.actors.kv_connector.shared_cache import allocate_shared
from cadenza.actors.kv_connector.nixl_transfer import NixlAgent
agent = NixlAgent([allocate_shared((1, 2, 2, 4, 1, 4), torch.float32, torch.device("cpu"), "node-a")])
start = time.process_time()
time.sleep(2)
print("IDLE", time.process_time() - start)
"""


def test_an_idle_agent_does_not_spin_a_core() -> None:
    """NIXL's own wrapper runs its progress thread with no pause: a core spun per worker, half
    of a 2-core machine, idle or not (it halved the served engines' speed). Ours pauses
    PROGRESS_EVERY_US between turns: about 3% of a core. Bounded at 25% of one."""
    run = subprocess.run([sys.executable, "-c", IDLE], capture_output=True, check=True, timeout=120)
    cpu_s = float(next(line for line in run.stdout.split(b"\n") if line.startswith(b"IDLE")).split()[1])
    assert cpu_s < 0.5
