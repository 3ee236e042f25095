"""KVCacheManager: per-request block tables on top of the BlockPool, and prefix-cache lookups."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from cadenza.actors.block_pool import BlockPool, KVBlock
from cadenza.actors.request import Request
from cadenza.actors.session_pins import SessionPins


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    """Chained, collision-resistant: equal hashes mean equal whole prefixes (and extra keys)."""
    return hashlib.sha256(msgspec.msgpack.encode([parent or b"", list(token_ids), list(extra_keys)])).digest()


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool,
        session_pin_ttl_s: float = 0.0,
        max_pinned_fraction: float = 0.0,
        max_pinned_sessions: int = 8192,
        max_pinned_sessions_per_tenant: int = 1024,
    ) -> None:
        self.pool = pool
        max_blocks = int(max_pinned_fraction * pool.num_blocks)
        self.pins = SessionPins(
            pool, max_blocks, session_pin_ttl_s, max_sessions=max_pinned_sessions,
            max_sessions_per_tenant=max_pinned_sessions_per_tenant,
        )  # fmt: skip
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: dict[str, list[KVBlock]] = {}
        self.hashes: dict[str, list[bytes]] = {}
        self.num_published: dict[str, int] = {}

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.blocks.get(req.request_id, [])]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the request's full blocks (prompt and output), extended as tokens arrive."""
        hashes = self.hashes.setdefault(req.request_id, [])
        tokens, bs = req.all_token_ids, self.block_size
        extra = (req.cache_salt,) if req.cache_salt else ()
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], extra))
        return hashes

    def find_cached(self, req: Request) -> list[KVBlock]:
        """Longest cached run of the request's leading full blocks; the last token always recomputes
        so the request gets logits to sample from."""
        may_share = self.enable_prefix_caching or req.prefix_leader is not None
        if not may_share or req.params.prompt_logprobs is not None:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self.block_hashes(req)[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[KVBlock] = ()) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens (after any cached blocks); None when they do not fit.
        Returns the ids appended to the request's block table."""
        blocks = self.blocks.setdefault(req.request_id, [])
        total = req.num_planned_tokens + len(cached) * self.block_size + num_new_tokens
        need = max(self.blocks_needed(total) - len(blocks) - len(cached), 0)
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)  # free-queue blocks the hits take
        if need > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(list(cached))
        added = [*cached, *self.pool.allocate(need)]
        blocks.extend(added)
        return [b.block_id for b in added]

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        self.pool.queries += req.num_tokens
        self.pool.hits += num_hit_tokens

    def publish(self, req: Request) -> None:
        """Make the request's newly completed, computed blocks findable by later requests."""
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        done = self.num_published.get(req.request_id, 0)
        if full <= done:
            return
        hashes, blocks = self.block_hashes(req), self.blocks[req.request_id]
        for i in range(done, full):
            self.pool.cache(blocks[i], hashes[i])
        self.num_published[req.request_id] = full

    def pin_session(self, req: Request) -> None:
        """A finished turn of a conversation: its cached blocks stay for the next turn. The
        session is its tenant's (the cache salt): another tenant naming the same session id
        pins its own blocks and can never replace these."""
        if req.session_id is not None and self.enable_prefix_caching:
            published = self.num_published.get(req.request_id, 0)
            self.pins.pin(req.session_id, self.blocks.get(req.request_id, [])[:published], req.cache_salt)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so a prefix outlives its own suffix in the cache."""
        blocks = self.blocks.pop(req.request_id, [])
        self.pool.release(blocks[::-1])
        self.num_published.pop(req.request_id, None)

    def reset(self) -> None:
        """After the workers' KV is lost: no request holds blocks any more (the caller freed
        them) and no cached block may be found again."""
        self.pins.clear()
        assert not any(self.blocks.values()), "reset while requests still hold blocks"
        self.blocks.clear()
        self.num_published.clear()
        self.pool.reset_cache()

    def forget(self, req: Request) -> None:
        """Drop per-request bookkeeping once the request is gone for good."""
        self.free(req)
        self.hashes.pop(req.request_id, None)
