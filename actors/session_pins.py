"""SessionPins: a conversation's prefix blocks held back from eviction between its turns.

When a request of a session (its conversation) finishes, its cached full blocks are pinned
for `ttl_s`: the pin holds a reference on each, so no allocation can evict them, and the
next turn finds its whole history in the prefix cache however much batch work ran in
between. A session's next pin replaces its last (the new turn's blocks extend the old
ones). All pins together hold at most `max_blocks`; past it the least recently pinned
session gives way, and a pin longer than the budget keeps its leading blocks (the prefix
every later turn needs first).

A session belongs to its tenant (the request's cache_salt, which the gateway derives from
the API key and the client's own cache_salt): pins are keyed by (tenant, session), so a
tenant that names another's session id pins and replaces only its own. Pins are also
bounded by count, `max_sessions` in all and `max_sessions_per_tenant` each (the oldest of
that tenant gives way): sessions whose blocks are all shared with other pins (one system
prompt) cost the block budget nothing, and without a count they would be unlimited. A pin
that would hold no blocks is not kept.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from cadenza.actors.block_pool import BlockPool, KVBlock

Key = tuple[str | None, str]  # (tenant, session)


class SessionPins:
    def __init__(
        self,
        pool: BlockPool,
        max_blocks: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = 8192,
        max_sessions_per_tenant: int = 1024,
    ) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_sessions = max_sessions
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self._pins: OrderedDict[Key, tuple[list[KVBlock], float]] = OrderedDict()  # -> (blocks, expiry)
        self._tenants: dict[str | None, OrderedDict[str, None]] = {}  # each tenant's sessions, oldest first
        # Pins per block id: sessions that share a prefix (a system prompt) hold it once.
        self._held: Counter[int] = Counter()

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._held)

    @property
    def num_sessions(self) -> int:
        return len(self._pins)

    def sessions_of(self, tenant: str | None) -> int:
        return len(self._tenants.get(tenant, ()))

    def pinned(self, session: str, tenant: str | None = None) -> list[int]:
        entry = self._pins.get((tenant, session))
        return [b.block_id for b in entry[0]] if entry else []

    def pinned_blocks(self) -> list[KVBlock]:
        """Every pinned block once, the most recently pinned sessions' first (a drain hands
        these over: what conversations will come back for)."""
        seen: dict[int, KVBlock] = {}
        for blocks, _ in reversed(self._pins.values()):
            for block in blocks:
                seen.setdefault(block.block_id, block)
        return list(seen.values())

    def pin(self, session: str, blocks: list[KVBlock], tenant: str | None = None) -> None:
        """Hold `blocks` (cached, in prefix order) for the tenant's session, replacing its last pin."""
        if self.ttl_s <= 0 or self.max_blocks <= 0:
            return
        blocks = blocks[: self.max_blocks]
        self.pool.touch(blocks)  # before the old pin lets go: shared blocks never hit the free queue
        self._unpin((tenant, session))
        if not blocks:
            return
        self._pins[(tenant, session)] = (blocks, self.clock() + self.ttl_s)
        self._tenants.setdefault(tenant, OrderedDict())[session] = None
        self._held.update(b.block_id for b in blocks)
        own = self._tenants[tenant]
        while len(own) > self.max_sessions_per_tenant:
            self._unpin((tenant, next(iter(own))))
        while self.num_pinned_blocks > self.max_blocks or len(self._pins) > self.max_sessions:
            self._unpin(next(iter(self._pins)))

    def unpin(self, session: str, tenant: str | None = None) -> None:
        self._unpin((tenant, session))

    def _unpin(self, key: Key) -> None:
        entry = self._pins.pop(key, None)
        if entry is None:
            return
        tenant, session = key
        own = self._tenants[tenant]
        del own[session]
        if not own:
            del self._tenants[tenant]
        self._held.subtract(b.block_id for b in entry[0])
        self._held += Counter()  # drops the ids no pin holds any more
        self.pool.release(entry[0][::-1])  # tail first, as a request frees: the prefix stays cached longest

    def expire(self) -> None:
        now = self.clock()
        for key in [k for k, (_, expiry) in self._pins.items() if expiry <= now]:
            self._unpin(key)

    def clear(self) -> None:
        for key in list(self._pins):
            self._unpin(key)

    def check_invariants(self) -> None:
        assert sum(len(s) for s in self._tenants.values()) == len(self._pins) <= self.max_sessions
        assert all(0 < len(s) <= self.max_sessions_per_tenant for s in self._tenants.values())
        assert all(blocks for blocks, _ in self._pins.values()), "a pin holds no blocks"
        assert self.num_pinned_blocks <= self.max_blocks or not self._pins
