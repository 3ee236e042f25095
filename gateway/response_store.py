"""Recent responses, kept so `previous_response_id` can continue a conversation.

A stored response keeps only its own turn (its input messages, then its reply) and the id of
the response it continued; a continuation joins the turns of its chain, renders them plus the
new input through the chat template, and the earlier turns are an exact token prefix that
comes out of the engine's prefix cache. A write is one turn, whatever the conversation's length
(the shared store's actor is sent that turn only); a read walks the chain.

A stored response belongs to its tenant (state.tenant_salt: the API key and the client's
cache_salt): another tenant's lookup, its continuation included, finds nothing, exactly as
for an id never issued.

ResponseStore is the bounded LRU itself: at most `response_store_size` responses and
`response_store_max_bytes` (each turn kept as its encoded JSON, so the bytes counted are the
bytes held), each for `response_store_ttl_s` after it was stored or last continued (reading
a chain refreshes every response in it, so a live conversation's first turns stay). A chain
whose earlier turn was dropped cannot be continued. The gateway reaches it through a
ConversationStore: LocalStore in its own process (`cadenza serve`), or
shared_store.SharedStore, one detached Ray actor every Serve replica of an application reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

Message = dict[str, Any]  # {"role": ..., "content": ...}, and tool_calls / tool_call_id on tool turns
# Per stored response besides its JSON: the Struct, the entry and the dict slot (measured ~250 B).
ENTRY_OVERHEAD_BYTES = 256


class StoredResponse(msgspec.Struct):
    """One response as the store keeps it (and as it crosses to the shared store's actor)."""

    response_id: str
    turn: bytes  # this response's own messages (its input, then its reply) as JSON
    parent: str | None = None  # the response it continued (its previous_response_id)
    session_id: str | None = None  # the conversation's, handed on to its continuations
    tenant: str | None = None  # whose it is: only this tenant finds it

    @classmethod
    def of(
        cls, response_id: str, turn: list[Message], parent: str | None, session_id: str | None, tenant: str | None
    ) -> StoredResponse:
        turn_json = bytes(memoryview(msgspec.json.encode(turn)))  # a copy: msgspec over-allocates 1.5x
        return cls(response_id, turn_json, parent, session_id, tenant)

    @property
    def size(self) -> int:
        ids = (self.response_id, self.parent, self.session_id, self.tenant)
        return len(self.turn) + sum(len(s) for s in ids if s) + ENTRY_OVERHEAD_BYTES


class Conversation(msgspec.Struct):
    """A stored response's whole conversation, its own reply last."""

    messages: list[Message]
    session_id: str | None = None


class ConversationStore(Protocol):
    async def get(self, response_id: str, tenant: str | None) -> Conversation | None: ...

    async def put(self, item: StoredResponse) -> None: ...

    async def size(self) -> int: ...


@dataclass(slots=True)
class _Entry:
    item: StoredResponse
    used_at: float  # stored, or last read as part of a chain


class ResponseStore:
    def __init__(
        self, max_size: int, ttl_s: float, max_bytes: int = 256 << 20, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_size, self.ttl_s, self.max_bytes = max_size, ttl_s, max_bytes
        self.clock = clock
        self.bytes = 0
        self._items: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first

    def put(self, item: StoredResponse) -> None:
        """Keeps the response unless it could never be read back: bigger than the whole store,
        or continuing a response no longer kept."""
        self._expire()
        if item.size > self.max_bytes or (item.parent is not None and item.parent not in self._items):
            return
        self._remove(item.response_id)
        self._items[item.response_id] = _Entry(item, self.clock())
        self.bytes += item.size
        while len(self._items) > self.max_size or self.bytes > self.max_bytes:
            self._remove(next(iter(self._items)))
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        """The turns at the front whose conversation lost an earlier turn: never readable."""
        while self._items:
            parent = next(iter(self._items.values())).item.parent
            if parent is None or parent in self._items:
                return
            self._remove(next(iter(self._items)))

    def get(self, response_id: str, tenant: str | None) -> Conversation | None:
        """The conversation up to that response, if it and every response it continued are kept
        and are the tenant's; reading it makes the whole chain the most recently used."""
        chain = self._chain(response_id, tenant)
        if chain is None:
            return None
        now = self.clock()
        # Root first, so the LRU drops a conversation whole: its first turn, then the rest
        # (orphaned, so useless), never a middle turn of a conversation it keeps.
        for entry in reversed(chain):
            entry.used_at = now
            self._items.move_to_end(entry.item.response_id)
        messages = [m for entry in reversed(chain) for m in msgspec.json.decode(entry.item.turn)]
        return Conversation(messages, chain[0].item.session_id)

    def __len__(self) -> int:
        return len(self._items)

    def _chain(self, response_id: str | None, tenant: str | None) -> list[_Entry] | None:
        chain: list[_Entry] = []
        now = self.clock()
        while response_id is not None:
            entry = self._items.get(response_id)
            if entry is None or entry.item.tenant != tenant or now - entry.used_at > self.ttl_s:
                return None
            chain.append(entry)
            if len(chain) > len(self._items):  # a cycle: ids are fresh, so never; but never loop
                return None
            response_id = entry.item.parent
        return chain

    def _remove(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.item.size

    def _expire(self) -> None:
        """Oldest use first, so the expired ones are at the front."""
        now = self.clock()
        while self._items:
            entry = next(iter(self._items.values()))
            if now - entry.used_at <= self.ttl_s:
                break
            self._remove(entry.item.response_id)
        self._drop_orphans()


class LocalStore:
    """The store in this process (one gateway, or tests)."""

    def __init__(self, max_size: int, ttl_s: float, max_bytes: int = 256 << 20) -> None:
        self.store = ResponseStore(max_size, ttl_s, max_bytes)

    async def get(self, response_id: str, tenant: str | None) -> Conversation | None:
        return self.store.get(response_id, tenant)

    async def put(self, item: StoredResponse) -> None:
        self.store.put(item)

    async def size(self) -> int:
        return len(self.store)
