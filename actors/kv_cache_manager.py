"""KVCacheManager: per-request block tables on top of the BlockPool, and prefix-cache lookups.

With `window` (a model whose every layer slides over its last `window` positions: Mistral,
Mixtral), blocks that no future query's window can reach go back to the pool as soon as the
request has computed past them (drop_behind_window), so a long conversation holds about a
window's worth of blocks, not its whole context. Their places in the block table stay (the
DROPPED marker), so positions keep their block index; the windowed attention path
(kernels/attention/windowed.py) never reads them, and the full-context paths run only while
every sequence fits the window, before anything is dropped.
"""

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


def extend_chain(hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """`hashes` (the chain of token_ids' first blocks so far) extended over every full block of
    token_ids, in place: the prefix cache's keys, shared with the KV connector."""
    extra = (cache_salt,) if cache_salt else ()
    for i in range(len(hashes), len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(hashes[-1] if hashes else None, block, extra))
    return hashes


# A block table's place whose block went back to the pool (behind every layer's window).
DROPPED = KVBlock(-1)


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
        window: int | None = None,
    ) -> None:
        self.pool = pool
        self.window = window
        self.num_dropped: dict[str, int] = {}
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

    def held_block_ids(self, req: Request) -> list[int]:
        """The blocks the request holds a reference on (its table less the dropped places)."""
        return [b.block_id for b in self.blocks.get(req.request_id, []) if b is not DROPPED]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a request of num_tokens holds at once, steps of up to step_tokens:
        all of them, or with a window the window behind the step, the step, and a block each
        side for alignment."""
        whole = self.blocks_needed(num_tokens)
        return whole if self.window is None else min(whole, self.blocks_needed(self.window + step_tokens) + 1)

    def drop_behind_window(self, req: Request) -> None:
        """Return the blocks wholly behind the window of every future query (each sits at
        num_computed_tokens or later and sees keys after its position - window)."""
        blocks = self.blocks.get(req.request_id)
        if self.window is None or not blocks:
            return
        behind = max(req.num_computed_tokens - self.window + 1, 0) // self.block_size
        start = self.num_dropped.get(req.request_id, 0)
        if behind <= start:
            return
        self.pool.release(blocks[start:behind][::-1])
        blocks[start:behind] = [DROPPED] * (behind - start)
        self.num_dropped[req.request_id] = behind

    def block_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the request's full blocks (prompt and output), extended as tokens arrive."""
        hashes = self.hashes.setdefault(req.request_id, [])
        return extend_chain(hashes, req.all_token_ids, self.block_size, req.cache_salt)

    def find_cached(self, req: Request) -> list[KVBlock]:
        """Longest cached run of the request's leading full blocks; the last token always recomputes
        so the request gets logits to sample from."""
        may_share = self.enable_prefix_caching or req.prefix_leader is not None
        if not may_share or req.params.prompt_logprobs is not None:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        return self.pool.cached_run(self.block_hashes(req)[:limit])

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
        """After a step: make the request's newly completed, computed blocks findable by later
        requests, then return those its window has left behind."""
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        done = self.num_published.get(req.request_id, 0)
        if full > done:
            hashes, blocks = self.block_hashes(req), self.blocks[req.request_id]
            for i in range(done, full):
                self.pool.cache(blocks[i], hashes[i])
            self.num_published[req.request_id] = full
        self.drop_behind_window(req)

    def pin_session(self, req: Request) -> None:
        """A finished turn of a conversation: its cached blocks stay for the next turn. The
        session is its tenant's (the cache salt): another tenant naming the same session id
        pins its own blocks and can never replace these."""
        if req.session_id is not None and self.enable_prefix_caching and not self.num_dropped.get(req.request_id):
            published = self.num_published.get(req.request_id, 0)
            self.pins.pin(req.session_id, self.blocks.get(req.request_id, [])[:published], req.cache_salt)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so a prefix outlives its own suffix in the cache."""
        blocks = self.blocks.pop(req.request_id, [])
        self.pool.release([b for b in blocks[::-1] if b is not DROPPED], keep_cached=self.enable_prefix_caching)
        self.num_published.pop(req.request_id, None)
        self.num_dropped.pop(req.request_id, None)

    def reset(self) -> None:
        """After the workers' KV is lost: no request holds blocks any more (the caller freed
        them) and no cached block may be found again."""
        self.pins.clear()
        assert not any(self.blocks.values()), "reset while requests still hold blocks"
        self.blocks.clear()
        self.num_published.clear()
        self.num_dropped.clear()
        self.pool.reset_cache()

    def forget(self, req: Request) -> None:
        """Drop per-request bookkeeping once the request is gone for good."""
        self.free(req)
        self.hashes.pop(req.request_id, None)
