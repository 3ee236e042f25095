"""gpu-check's cases for the `ipc` and `nixl` KV transports (actors/kv_connector/shared_cache.py,
nixl_transfer.py): another process allocates a shared cache set (a CUDA IPC handle on a GPU, a
memfd on the CPU) and fills it; this process opens it and pulls blocks out of it (`kv_pull`), or
reads them through NIXL from the other process's agent (`kv_nixl`, where NIXL is installed), as
a decode engine pulls a prefill engine's. Checked bit for bit against the same values made here
(one seeded generator, one device); timed against the same copy between two caches of this
process (what a transport can approach)."""

from __future__ import annotations

import multiprocessing
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import msgspec
import torch

from cadenza.actors.kv_connector.handoff import KVShare
from cadenza.actors.kv_connector.nixl_transfer import NixlAgent, nixl_installed
from cadenza.actors.kv_connector.shared_cache import PeerCaches, allocate_shared, pull_blocks
from cadenza.benchmarks.gpu_cases import Case, Plan

PLACE = "gpu-check"  # both processes are on this machine, on one device
SEED = 1234
EXPORTER_START_S = 300  # spawning the exporter imports torch (and initialises CUDA)


def kv_pull_cases(plan: Plan, dtype: torch.dtype, dev: torch.device) -> Iterator[Case]:
    for n in plan.handoff_blocks:
        yield _kv_pull_case(plan, n, dtype, dev, nixl=False)
    if nixl_installed():  # else the report's kernels have no kv_nixl
        for n in plan.handoff_blocks:
            yield _kv_pull_case(plan, n, dtype, dev, nixl=True)


def _values(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=dev).manual_seed(SEED)
    return torch.randn(shape, generator=generator, device=dev).to(dtype)


def _exporter(conn: Connection, shape: tuple[int, ...], dtype_name: str, device: str, nixl: bool) -> None:
    """The other process: a filled shared cache set, its KVShare sent (msgpack; naming a NIXL
    agent over it with nixl), kept until told."""
    dev = torch.device(device)
    caches = allocate_shared(shape, getattr(torch, dtype_name), dev, PLACE)
    caches.base.copy_(_values(shape, caches.base.dtype, dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    agent = NixlAgent([caches]) if nixl else None
    conn.send_bytes(msgspec.msgpack.encode(caches.share if agent is None else agent.shares()[0]))
    conn.recv_bytes()  # the importer is done with it


def _start_exporter(
    shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, nixl: bool
) -> tuple[KVShare, Callable[[], None]]:
    """The exporter's share, and what stops it when called."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    args = (theirs, shape, str(dtype).removeprefix("torch."), str(dev), nixl)
    proc = ctx.Process(target=_exporter, args=args, daemon=True)
    proc.start()
    if not ours.poll(EXPORTER_START_S):
        proc.kill()
        raise RuntimeError("the exporting process sent no KV share")
    share = msgspec.msgpack.decode(ours.recv_bytes(), type=KVShare)

    def stop() -> None:
        ours.send_bytes(b"done")
        proc.join(30)

    return share, stop


def _kv_pull_case(plan: Plan, n: int, dtype: torch.dtype, dev: torch.device, nixl: bool) -> Case:
    shape = (plan.handoff_layers, 2, 2 * n + 1, plan.block_size, plan.kv_heads, plan.head_dim)
    share, stop = _start_exporter(shape, dtype, dev, nixl)
    local = _values(shape, dtype, dev)  # the same values, made here: the reference and the baseline's source
    target = allocate_shared(shape, dtype, dev, PLACE)  # a NIXL agent registers one allocation
    src = torch.randperm(shape[2], device=dev)[:n]
    dst = torch.randperm(shape[2], device=dev)[:n]
    if nixl:
        agent = NixlAgent([target])
        weakref.finalize(agent, stop)  # the exporter stops once the case (its closures) is freed

        def pulled() -> None:
            agent.pull(dst.tolist(), [share], src.tolist())
    else:
        source = PeerCaches(PLACE).tensor(share)
        weakref.finalize(source, stop)

        def pulled() -> None:
            pull_blocks(target, dst.tolist(), source, src.tolist())

    def run() -> torch.Tensor:
        pulled()
        return torch.stack([torch.stack((k.index_select(0, dst), v.index_select(0, dst))) for k, v in target])

    def in_process() -> None:
        pull_blocks(target, dst.tolist(), local, src.tolist())

    return Case(
        kernel="kv_nixl" if nixl else "kv_pull",
        shape={"blocks": n, "layers": shape[0], "kv_heads": shape[4], "head_dim": shape[5], "block_size": shape[3]},
        run=run,
        ref=lambda: local[:, :, src],
        exact=None,
        baseline=in_process,
        bench=pulled,
        bytes=2 * shape[0] * n * local[0, 0, 0].numel() * local.element_size(),
    )
