"""SharedStore: the conversation store as one detached Ray actor, read by every replica.

Why an actor rather than Ray's internal KV: the store must stay bounded (LRU size and TTL,
the same ResponseStore as one gateway's), and an actor runs that logic where the data is;
the KV has neither eviction nor TTL, so every replica would have to agree on them. One
named, detached actor per Serve application (`get_if_exists`), so replicas created later,
or after a replacement, find the same store; a call is one small actor round trip (~1 ms),
paid once per turn, never per token. For several nodes it lives wherever Ray places it; a
store outside Ray (Redis) would be the next step for a cluster that restarts Ray itself.
"""

from __future__ import annotations

import ray

from cadenza.gateway.response_store import Message, ResponseStore, StoredResponse

ACTOR_NAME = "cadenza-response-store"


@ray.remote(num_cpus=0)
class _StoreActor:
    def __init__(self, max_size: int, ttl_s: float) -> None:
        self.store = ResponseStore(max_size, ttl_s)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    def put(self, item: StoredResponse) -> None:
        self.store.put(item.response_id, item.messages, item.session_id)

    def size(self) -> int:
        return len(self.store)


class SharedStore:
    def __init__(self, max_size: int, ttl_s: float, name: str = ACTOR_NAME) -> None:
        self.actor = _StoreActor.options(name=name, lifetime="detached", get_if_exists=True).remote(max_size, ttl_s)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self.actor.get.remote(response_id)

    async def put(self, response_id: str, messages: list[Message], session_id: str | None = None) -> None:
        await self.actor.put.remote(StoredResponse(response_id, messages, session_id))

    async def size(self) -> int:
        return await self.actor.size.remote()
