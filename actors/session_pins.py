"""SessionPins: a conversation's prefix blocks held back from eviction between its turns.

When a request of a session (its conversation) finishes, its cached full blocks are pinned
for `ttl_s`: the pin holds a reference on each, so no allocation can evict them, and the
next turn finds its whole history in the prefix cache however much batch work ran in
between. A session's next pin replaces its last (the new turn's blocks extend the old
ones). All pins together hold at most `max_blocks`; past it the least recently pinned
session gives way, and a pin longer than the budget keeps its leading blocks (the prefix
every later turn needs first).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from cadenza.actors.block_pool import BlockPool, KVBlock


class SessionPins:
    def __init__(
        self, pool: BlockPool, max_blocks: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self._pins: OrderedDict[str, tuple[list[KVBlock], float]] = OrderedDict()  # session -> (blocks, expiry)
        # Pins per block id: sessions that share a prefix (a system prompt) hold it once.
        self._held: Counter[int] = Counter()

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._held)

    def pinned(self, session: str) -> list[int]:
        entry = self._pins.get(session)
        return [b.block_id for b in entry[0]] if entry else []

    def pin(self, session: str, blocks: list[KVBlock]) -> None:
        """Hold `blocks` (cached, in prefix order) for the session, replacing its last pin."""
        if self.ttl_s <= 0 or self.max_blocks <= 0:
            return
        blocks = blocks[: self.max_blocks]
        self.pool.touch(blocks)  # before the old pin lets go: shared blocks never hit the free queue
        self.unpin(session)
        self._pins[session] = (blocks, self.clock() + self.ttl_s)
        self._held.update(b.block_id for b in blocks)
        while self.num_pinned_blocks > self.max_blocks:
            self.unpin(next(iter(self._pins)))

    def unpin(self, session: str) -> None:
        entry = self._pins.pop(session, None)
        if entry is not None:
            self._held.subtract(b.block_id for b in entry[0])
            self._held += Counter()  # drops the ids no pin holds any more
            self.pool.release(entry[0][::-1])  # tail first, as a request frees: the prefix stays cached longest

    def expire(self) -> None:
        now = self.clock()
        for session in [s for s, (_, expiry) in self._pins.items() if expiry <= now]:
            self.unpin(session)

    def clear(self) -> None:
        for session in list(self._pins):
            self.unpin(session)
