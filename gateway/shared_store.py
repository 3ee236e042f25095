"""SharedStore: the conversation store as one detached Ray actor, read by every replica.

Why an actor rather than Ray's internal KV: the store must stay bounded (count, bytes and TTL,
the same ResponseStore as one gateway's), and an actor runs that logic where the data is;
the KV has neither eviction nor TTL, so every replica would have to agree on them. One
named, detached actor per Serve application (`store_name`: the application and its model),
so replicas created later, or after a replacement, find the same store, and two Cadenza
applications in one cluster never share one. A write sends one turn (StoredResponse), never
the conversation; a read brings the conversation back; each is one small actor round trip
(~1 ms), paid once per turn, never per token.

The actor is detached, so nothing else restarts it: Ray restarts it after a crash
(max_restarts), and a call that finds it dead (killed, or its node lost) creates it again under
the same name and retries once. Its contents are lost with it: a conversation stored before
cannot be continued (`previous_response_not_found`), as after its TTL. For several nodes it
lives wherever Ray places it; a store outside Ray (Redis) would be the next step for a cluster
that restarts Ray itself.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from cadenza.gateway.named_actor import NamedActorClient
from cadenza.gateway.response_store import Conversation, ResponseStore, StoredResponse

ACTOR_PREFIX = "cadenza-response-store"

log = logging.getLogger(__name__)


def store_name(app_name: str, model_name: str) -> str:
    """The store's actor name: one per Serve application (and its model)."""
    return f"{ACTOR_PREFIX}:{app_name}:{model_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class _StoreActor:
    def __init__(self, max_size: int, ttl_s: float, max_bytes: int) -> None:
        self.store = ResponseStore(max_size, ttl_s, max_bytes)

    def get(self, response_id: str, tenant: str | None) -> Conversation | None:
        return self.store.get(response_id, tenant)

    def put(self, item: StoredResponse) -> None:
        self.store.put(item)

    def size(self) -> int:
        return len(self.store)

    def stored_bytes(self) -> int:
        return self.store.bytes


class SharedStore(NamedActorClient):
    def __init__(self, max_size: int, ttl_s: float, max_bytes: int, name: str) -> None:
        self.args = (max_size, ttl_s, max_bytes)
        super().__init__(name)

    def _connect(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        options = _StoreActor.options(name=self.name, lifetime="detached", get_if_exists=True)
        return options.remote(*self.args)

    async def get(self, response_id: str, tenant: str | None) -> Conversation | None:
        return await self._call("get", response_id, tenant)

    async def put(self, item: StoredResponse) -> None:
        await self._call("put", item)

    async def size(self) -> int:
        return await self._call("size")

    async def stored_bytes(self) -> int:
        return await self._call("stored_bytes")
