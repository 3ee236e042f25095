"""What crosses from a prefill engine to a decode engine: the hash chain of the blocks
exported (the prefix cache's keys, so the importer can skip what it holds and file the rest
where a lookup finds them) and their bytes, one object-store reference per worker
(blocks.py's array), kept beside the Struct so Ray counts the references; and move_blocks, the
one export-then-import every hand-over runs (disaggregation's in parts, as the prompt's chunks
are cached; Serve's pulls whole, move_kv)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import msgspec

from cadenza.stats import KVTransferStats


class KVShare(msgspec.Struct, frozen=True, kw_only=True):
    """How a process at `place` opens one shared cache set."""

    place: str  # where it opens: the Ray node, and on CUDA the GPU (runner_setup.kv_place)
    pid: int  # the exporting process
    name: str  # CPU: the memfd's name (random), checked before mapping; CUDA: a random tag
    fd: int = -1  # CPU: the memfd in pid's descriptor table
    shape: list[int]  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    dtype: str  # torch's name: "float32", "bfloat16", ...
    cuda: list[Any] | None = None  # CUDA: the storage's IPC handle and its fields (bytes, ints, a bool)
    # The `nixl` transport (nixl_transfer.py): the worker's agent, its metadata (NIXL's own
    # encoding) and where the set starts in the exporting process (and on which GPU).
    nixl_agent: str = ""
    nixl_md: bytes = b""
    addr: int = 0
    device_id: int = 0


class KVPull(msgspec.Struct, kw_only=True):
    """Blocks an exporter holds for an importer on its node to copy out of its shared caches
    (the `ipc` transport), until it is told the copy is done (`lease`) or expires_at."""

    lease: int
    block_ids: list[int]  # the exporter's blocks, in block_hashes' order
    shares: list[list[KVShare]]  # per worker (the same order on both sides), per cache set
    expires_at: float  # time.monotonic() on the node
    wall_expires_at: float = 0.0  # the same end by time.time(), for a NIXL pull from another node

    @property
    def lease_end(self) -> tuple[float, float]:
        """(expires_at, wall_expires_at): what a worker's pull checks its copy against."""
        return self.expires_at, self.wall_expires_at


class KVHandoff(msgspec.Struct, kw_only=True):
    block_hashes: list[bytes]  # a prompt's leading run of cached blocks, or a drain's pinned ones
    block_size: int
    pull: KVPull | None = None  # where the bytes are to be copied from; None: the refs beside it hold them


class KVImport(msgspec.Struct, kw_only=True):
    """What an importer did with a handoff."""

    num_imported: int  # blocks written and filed in the prefix cache
    num_skipped: int  # blocks its prefix cache already held (not written)
    num_bytes: int  # bytes written


async def move_blocks(
    export: Awaitable[tuple[KVHandoff, list[Any]]],
    import_kv: Callable[[KVHandoff, list[Any]], Awaitable[KVImport]],
    stats: KVTransferStats,
    release: Callable[[int], Awaitable[None]] | None = None,
) -> int:
    """What `export` yields filed by `import_kv` into the importer's prefix cache, counted in
    `stats`; a pull's lease then ended by `release` (the exporter's), whatever the import did.
    Returns the blocks the exporter held (one part of a hand-over)."""
    handoff, refs = await export
    try:
        if handoff.block_hashes:
            done = await import_kv(handoff, refs)
            stats.num_blocks_imported += done.num_imported
            stats.num_blocks_skipped += done.num_skipped
            stats.num_bytes += done.num_bytes
            stats.num_blocks_pulled += done.num_imported if handoff.pull is not None else 0
    finally:
        if handoff.pull is not None and release is not None:
            with suppress(Exception):  # best effort: a lease no one ends runs out at kv_lease_s
                await release(handoff.pull.lease)
    return len(handoff.block_hashes)


async def move_kv(
    export: Awaitable[tuple[KVHandoff, list[Any]]],
    import_kv: Callable[[KVHandoff, list[Any]], Awaitable[KVImport]],
    stats: KVTransferStats,
    release: Callable[[int], Awaitable[None]] | None = None,
) -> int:
    """One hand-over in one part (Serve's replica-to-replica pulls): move_blocks, counted as
    a hand-over."""
    moved = await move_blocks(export, import_kv, stats, release)
    stats.num_handoffs += 1
    return moved
