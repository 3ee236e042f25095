"""What crosses from a prefill engine to a decode engine: the hash chain of the blocks
exported (the prefix cache's keys, so the importer can skip what it holds and file the rest
where a lookup finds them) and their bytes, one object-store reference per worker
(blocks.py's array), kept beside the Struct so Ray counts the references."""

from __future__ import annotations

import msgspec


class KVHandoff(msgspec.Struct, kw_only=True):
    block_hashes: list[bytes]  # a prompt's leading run of cached blocks, or a drain's pinned ones
    block_size: int


class KVImport(msgspec.Struct, kw_only=True):
    """What an importer did with a handoff."""

    num_imported: int  # blocks written and filed in the prefix cache
    num_skipped: int  # blocks its prefix cache already held (not written)
    num_bytes: int  # bytes written
