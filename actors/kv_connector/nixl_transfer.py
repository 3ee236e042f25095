"""The `nixl` KV transport: each worker registers its shared cache sets (shared_cache.py's one
allocation per set) with a NIXL agent, and an importer's worker reads the exporter's leased
blocks straight into its own, one-sided: the exporting worker does nothing while it is read.
NIXL picks the path underneath (UCX: shared memory or cross-memory attach between processes
on a host, CUDA IPC or NVLink between GPUs of a node, RDMA or TCP between nodes), so unlike
`ipc` it also moves KV between nodes and between GPUs without staging it in host memory.

A read is one descriptor per layer, K or V, and run of blocks consecutive on both sides
(shared_cache.block_runs): a prompt's fresh blocks mostly run, so a pull is a few descriptors
per layer. An agent's metadata (its name, endpoints and registered memory) travels in the
KVShare; NIXL parses it itself, nothing is unpickled. UCX opens its transports on the node's
network interfaces: `UCX_NET_DEVICES` and `UCX_TLS` narrow them (docs/deployment.md)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import threading
import time
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import torch

from cadenza.actors.kv_connector.handoff import KVShare
from cadenza.actors.kv_connector.shared_cache import KVCacheSet, KVShareGone, block_runs, check_fits
from cadenza.config_checks import NIXL_PACKAGES

# The agents a worker keeps connected; an older one (an exporter rebuilt or gone) is dropped.
MAX_PEERS = 32
# How often NIXL's progress thread moves transfers along, in microseconds. It has to run: a
# peer's first read needs this side to answer UCX's wire-up, and reads over TCP need it
# throughout. NIXL's Python wrapper (nixl_agent) fixes it at 0, a thread spinning a whole core
# even while idle (half of a 2-core machine: it halved the served engines' speed); at 1 ms it
# costs about 3% of a core (an idle agent, Zen 4), and an importer polls its own reads.
PROGRESS_EVERY_US = 1000
# NIXL's API: the `nixl` meta package picks its CUDA build; without it, a build installed by
# name (the CPU machines' suite installs nixl-cu12, which runs without a GPU). Used through its
# bindings, whose config sets the progress thread's pace.
_APIS = tuple(f"{package}._api" for package in NIXL_PACKAGES)


def nixl_bindings() -> ModuleType:
    for name in _APIS:
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:  # else its modules log to stdout at INFO
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api.nixlBind
    raise RuntimeError("kv_transport nixl needs NIXL: pip install nixl (on a CPU host, nixl-cu12 runs without a GPU)")


def nixl_installed() -> bool:
    try:
        nixl_bindings()
    except RuntimeError:
        return False
    return True


def _segment(bind: ModuleType, tensor: torch.Tensor) -> Any:  # noqa: ANN401 - NIXL's memory type
    return bind.VRAM_SEG if tensor.device.type == "cuda" else bind.DRAM_SEG


def _device_id(tensor: torch.Tensor) -> int:
    return tensor.device.index or 0  # NIXL names DRAM device 0


class NixlAgent:
    """A worker's NIXL agent over its cache sets: their shares name it (shares()), and its reads
    (pull) copy a peer's blocks into them."""

    def __init__(self, sets: list[KVCacheSet]) -> None:
        self.bind = bind = nixl_bindings()
        self.name = f"cadenza-kv-{secrets.token_hex(8)}"
        config = bind.nixlAgentConfig()
        config.useProgThread, config.useListenThread, config.pthrDelay = True, False, PROGRESS_EVERY_US
        config.syncMode = bind.NIXL_THREAD_SYNC_NONE  # as NIXL's wrapper: reads are one at a time here
        self.agent = bind.nixlAgent(self.name, config)
        self.agent.createBackend("UCX", {})
        self.sets = sets
        for caches in sets:
            base = caches.base
            assert base is not None, "a NIXL agent registers shared cache sets (one allocation each)"
            region = [(base.data_ptr(), _nbytes(base), _device_id(base), "")]
            self.agent.registerMem(bind.nixlRegDList(_segment(bind, base), region), [])
        self.metadata = self.agent.getLocalMD()
        self._peers: dict[str, None] = {}  # the agents connected, oldest first
        # One read at a time: imports run on threads (asyncio.to_thread), and the agent does
        # not lock itself (sync mode NONE).
        self._lock = threading.Lock()

    def shares(self) -> list[KVShare]:
        """The sets' shares, naming this agent and where each set starts in this process."""
        return [
            msgspec.structs.replace(
                caches.share,
                nixl_agent=self.name,
                nixl_md=self.metadata,
                addr=caches.base.data_ptr(),
                device_id=_device_id(caches.base),
            )
            for caches in self.sets
        ]

    def pull(self, block_ids: list[int], shares: list[KVShare], source_ids: list[int]) -> int:
        """Blocks source_ids of the peer's sets (their shares) read into block_ids of ours, one
        transfer for all sets; returns the bytes."""
        with self._lock:
            return self._pull(block_ids, shares, source_ids)

    def _pull(self, block_ids: list[int], shares: list[KVShare], source_ids: list[int]) -> int:
        peer = self._connect(shares[0])
        local, remote = [], []
        for caches, share in zip(self.sets, shares, strict=True):
            check_fits(caches, share.shape, getattr(torch, share.dtype))
            mine, theirs = _descriptors(caches.base, share, block_ids, source_ids)
            local.append(mine)
            remote.append(theirs)
        bind, segment = self.bind, _segment(self.bind, self.sets[0].base)
        here, there = (
            bind.nixlXferDList(segment, np.concatenate(local)),
            bind.nixlXferDList(segment, np.concatenate(remote)),
        )
        try:
            handle = self.agent.createXferReq(bind.NIXL_READ, here, there, peer, b"", [])
            try:
                _wait(bind, self.agent, handle)
            finally:
                self.agent.releaseXferReq(handle)
        except Exception as e:  # NIXL's own errors (nixlRemoteDisconnectError, ...): the peer is gone
            self._forget(peer)
            raise KVShareGone(f"a NIXL read of {peer}'s KV failed: {e}") from e
        return sum(int(part[:, 1].sum()) for part in local)

    def _forget(self, peer: str) -> None:
        if peer in self._peers:
            del self._peers[peer]
            with contextlib.suppress(Exception):  # already disconnected: nothing more to undo
                self.agent.invalidateRemoteMD(peer)

    def _connect(self, share: KVShare) -> str:
        if share.nixl_agent not in self._peers:
            if len(self._peers) >= MAX_PEERS:
                self._forget(next(iter(self._peers)))
            try:
                self.agent.loadRemoteMD(share.nixl_md)
            except Exception as e:
                raise KVShareGone(f"NIXL could not load the exporter's agent {share.nixl_agent}: {e}") from e
            self._peers[share.nixl_agent] = None
        return share.nixl_agent


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _descriptors(
    base: torch.Tensor, share: KVShare, block_ids: list[int], source_ids: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(address, bytes, device) rows, here and there: one per layer, K or V, and run of blocks
    consecutive on both sides. Both sets are [layers, 2, blocks, *block] in one allocation."""
    runs = np.array(block_runs(block_ids, source_ids), dtype=np.int64).reshape(-1, 3)
    block_bytes = _nbytes(base[0, 0, 0])
    planes = np.arange(base.shape[0] * 2, dtype=np.int64)[:, None]  # (layer, K/V) in memory order
    lengths = np.broadcast_to(runs[:, 2] * block_bytes, (len(planes), len(runs))).ravel()

    def rows(start: int, num_blocks: int, first: np.ndarray, device: int) -> np.ndarray:
        addresses = (start + (planes * num_blocks + first) * block_bytes).ravel()
        return np.stack([addresses, lengths, np.full_like(lengths, device)], axis=1).astype(np.uint64)

    here = rows(base.data_ptr(), base.shape[2], runs[:, 0], _device_id(base))
    return here, rows(share.addr, share.shape[2], runs[:, 1], share.device_id)


def _wait(bind: ModuleType, agent: Any, handle: Any) -> None:  # noqa: ANN401 - NIXL's agent and transfer
    """Until the read is done (polling also moves it along, between the progress thread's turns)."""
    status, pause = agent.postXferReq(handle, b""), 1e-5
    while status == bind.NIXL_IN_PROG:
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
        status = agent.getXferStatus(handle)
    if status != bind.NIXL_SUCCESS:
        raise RuntimeError(f"the transfer ended with status {status}")
