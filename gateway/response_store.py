"""Recent responses, kept so `previous_response_id` can continue a conversation.

A stored response holds the whole conversation up to and including its own output; a
continuation renders that plus the new input through the chat template, so the earlier
turns are an exact token prefix and come out of the engine's prefix cache.

ResponseStore is the bounded LRU itself. The gateway reaches it through a ConversationStore:
LocalStore in its own process (`cadenza serve`), or shared_store.SharedStore, one detached
Ray actor every Serve replica reads, so a conversation the router moves to another replica
still finds its history there (its prefix KV is then recomputed on the new replica).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Protocol

import msgspec

Message = dict[str, Any]  # {"role": ..., "content": ...}, and tool_calls / tool_call_id on tool turns


class StoredResponse(msgspec.Struct):
    response_id: str
    messages: list[Message]
    session_id: str | None = None  # the conversation's, handed on to its continuations
    stored_at: float = msgspec.field(default_factory=time.monotonic)


class ConversationStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, response_id: str, messages: list[Message], session_id: str | None = None) -> None: ...

    async def size(self) -> int: ...


class ResponseStore:
    def __init__(self, max_size: int, ttl_s: float) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, messages: list[Message], session_id: str | None = None) -> None:
        self._items[response_id] = StoredResponse(response_id, messages, session_id)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is None:
            return None
        if time.monotonic() - item.stored_at > self.ttl_s:
            del self._items[response_id]
            return None
        self._items.move_to_end(response_id)
        return item

    def __len__(self) -> int:
        return len(self._items)


class LocalStore:
    """The store in this process (one gateway, or tests)."""

    def __init__(self, max_size: int, ttl_s: float) -> None:
        self.store = ResponseStore(max_size, ttl_s)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def put(self, response_id: str, messages: list[Message], session_id: str | None = None) -> None:
        self.store.put(response_id, messages, session_id)

    async def size(self) -> int:
        return len(self.store)
