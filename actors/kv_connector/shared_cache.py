"""KV caches that another engine on the same node reads in place: the `ipc` KV transport.

A shared cache set is one allocation, [layers, 2, blocks, block_size, kv_heads, head_dim], whose
per-layer K and V are views. A peer process opens it once (KVShare says how) and then copies
the blocks it is handed straight out of it, one copy, while the exporting engine holds them
(a lease, engine_port.py); the object store takes three (gather, put, scatter) and a round trip
through shared memory. On the CPU the allocation is a memfd: no file exists to leak, the kernel
frees it with the last process that maps it, and a peer opens it through /proc/<pid>/fd after
checking the descriptor still names this memfd (a reused pid or fd is somebody else's). On
CUDA it is one device buffer, opened by its CUDA IPC handle by a process on the same GPU
(runner_setup.kv_place: Ray shows each worker only its own GPU)."""

from __future__ import annotations

import math
import mmap
import os
import secrets
import time
import warnings
import weakref

import torch

from cadenza.actors.kv_connector.handoff import KVShare

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
# A pull whose blocks run consecutively on both sides for this many on average copies slices
# (one pass); shorter runs gather and scatter by index (a temporary, two passes, but no call
# per block). Freshly allocated blocks on both sides mostly run: 128 blocks of SmolLM2 in 8.7
# against 14.6 ms, 2 threads on Zen 4.
MIN_RUN = 4
# How far apart two nodes' wall clocks may be (NTP keeps them within milliseconds) for a pull
# from another node to trust its exporter's lease end (check_lease).
NODE_CLOCK_SKEW_S = 1.0


class KVCacheSet(list):  # noqa: FURB189 - a plain list of (K, V) the model reads, plus how to share it
    """A cache set's (K, V) per layer; `share` is set when a peer can open it (KVShare)."""

    share: KVShare | None = None
    base: torch.Tensor | None = None  # the one allocation every layer's K and V views


class KVShareGone(RuntimeError):
    """A share can no longer be opened (its process or node is not this one, or it is gone)."""


class KVLeaseExpired(RuntimeError):
    """A pull finished after the exporter's lease ran out: what it copied may be overwritten."""


def allocate_shared(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, place: str) -> KVCacheSet:
    """Zeroed caches of shape [layers, 2, *block_shape] in one shareable allocation (on the
    CPU resident only as blocks are first written, like kv_tensors.zeroed_kv_tensor)."""
    name = f"cadenza-kv-{secrets.token_hex(8)}"
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        base = torch.zeros(shape, dtype=dtype, device=device)
        args = reduce_tensor(base)[1]  # rebuild_cuda_tensor's: the storage's IPC fields at 6-9 and 11-14
        fields = [*args[6:10], *args[11:15]]
        fd = -1
    else:
        count = math.prod(shape)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)  # kept open: peers find it in /proc/<pid>/fd
        os.ftruncate(fd, count * dtype.itemsize)
        base = torch.frombuffer(mmap.mmap(fd, count * dtype.itemsize), dtype=dtype, count=count).view(shape)
        fields = None
    caches = KVCacheSet((base[layer, 0], base[layer, 1]) for layer in range(shape[0]))
    caches.share = KVShare(
        place=place, pid=os.getpid(), name=name, fd=fd, shape=list(shape), dtype=str(dtype).removeprefix("torch."),
        cuda=fields,
    )  # fmt: skip
    caches.base = base  # keeps the allocation (and on the CPU the memfd's mapping) alive
    if fd >= 0:  # the memfd goes with the caches (an engine rebuilding its worker in-process)
        weakref.finalize(caches, os.close, fd)
    return caches


def _open(share: KVShare, place: str) -> torch.Tensor:
    if share.place != place:
        raise KVShareGone(f"the KV share opens at {share.place}, not here ({place})")
    dtype = getattr(torch, share.dtype)
    if share.cuda is not None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        device, handle, size, offset, counter, counter_offset, event, event_sync = share.cuda
        stride = torch.empty(share.shape, device="meta").stride()
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(share.shape), stride, 0, torch.storage.TypedStorage, dtype, device, handle, size,
            offset, False, counter, counter_offset, event, event_sync,
        )  # fmt: skip
    path = f"/proc/{share.pid}/fd/{share.fd}"
    try:
        if os.readlink(path) != _memfd_link(share):
            raise KVShareGone(f"{path} is no longer the KV share {share.name}")
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise KVShareGone(f"the KV share {share.name} is gone: {e}") from e
    try:
        count = math.prod(share.shape)
        buf = mmap.mmap(fd, count * dtype.itemsize, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only: this side only copies out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count).view(share.shape)


def _memfd_link(share: KVShare) -> str:
    """What /proc/<pid>/fd/<fd> points to while it is the share's memfd."""
    return f"/memfd:{share.name} (deleted)"


def _alive(share: KVShare) -> bool:
    if share.cuda is not None:
        return os.path.exists(f"/proc/{share.pid}")
    try:
        return os.readlink(f"/proc/{share.pid}/fd/{share.fd}") == _memfd_link(share)
    except OSError:
        return False


class PeerCaches:
    """The shares this process has opened, by name; one whose process is gone is dropped (its
    memory goes with the last mapping)."""

    def __init__(self, place: str) -> None:
        self.place = place  # this process's (runner_setup.kv_place)
        self._open: dict[str, tuple[KVShare, torch.Tensor]] = {}

    def tensor(self, share: KVShare) -> torch.Tensor:
        for name, (known, _) in list(self._open.items()):
            if name != share.name and not _alive(known):
                del self._open[name]
        if share.name not in self._open:
            self._open[share.name] = (share, _open(share, self.place))
        return self._open[share.name][1]


def pull_blocks(caches: KVCaches, block_ids: list[int], source: torch.Tensor, source_ids: list[int]) -> int:
    """Copy blocks source_ids of a peer's shared set (PeerCaches.tensor) into block_ids here,
    layer by layer; returns the bytes."""
    check_fits(caches, list(source.shape), source.dtype)
    k0 = caches[0][0]
    runs = block_runs(block_ids, source_ids)
    if len(runs) * MIN_RUN <= len(block_ids):  # mostly consecutive on both sides: one copy, no gather
        for layer, (k, v) in enumerate(caches):
            for to, start, n in runs:
                k[to : to + n].copy_(source[layer, 0, start : start + n])
                v[to : to + n].copy_(source[layer, 1, start : start + n])
    else:
        index = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        picked = torch.tensor(source_ids, dtype=torch.long, device=source.device)
        for layer, (k, v) in enumerate(caches):
            k.index_copy_(0, index, source[layer, 0].index_select(0, picked).to(k.device))
            v.index_copy_(0, index, source[layer, 1].index_select(0, picked).to(v.device))
    if k0.device.type == "cuda":
        torch.cuda.current_stream(k0.device).synchronize()  # the copy is done before the lease is checked
    return 2 * len(caches) * len(block_ids) * k0[0].numel() * k0.element_size()


def check_fits(caches: KVCaches, shape: list[int], dtype: torch.dtype) -> None:
    """A peer's cache set of `shape` ([layers, 2, blocks, *block]) and dtype holds this shard's
    blocks: the same layers, block shape and dtype (its block count may differ)."""
    k0 = caches[0][0]
    if shape[0] != len(caches) or shape[3:] != list(k0.shape[1:]) or dtype != k0.dtype:
        raise ValueError(f"a peer's KV of shape {tuple(shape)} ({dtype}) does not fit this cache")


def block_runs(block_ids: list[int], source_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first block here, first block there, length) of the runs consecutive on both sides."""
    runs: list[list[int]] = []
    for to, start in zip(block_ids, source_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == to and runs[-1][1] + runs[-1][2] == start:
            runs[-1][2] += 1
        else:
            runs.append([to, start, 1])
    return [(to, start, n) for to, start, n in runs]


def check_lease(expires_at: float, wall_expires_at: float, same_node: bool) -> None:
    """A pull's copy counts only if it ended inside the lease: the exporter releases the blocks
    at expires_at (time.monotonic, one clock on a node), never before. From another node (the
    `nixl` transport) only the wall clocks compare, so the copy must end NODE_CLOCK_SKEW_S
    before the lease's wall-clock end."""
    if same_node:
        expired = time.monotonic() >= expires_at
    else:
        expired = time.time() + NODE_CLOCK_SKEW_S >= wall_expires_at
    if expired:
        raise KVLeaseExpired("the exporting engine's lease on the blocks ran out before the copy ended")
