"""Issue #38, the conversation store: one turn per stored response, joined along its chain; the
tenant's only; bounded in count, bytes and TTL (memory measured); and the Serve-wide store
actor named per application and started again, empty, once it died."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from cadenza.gateway.response_store import ResponseStore, StoredResponse


def _turn(response_id: str, said: str, parent: str | None = None, tenant: str | None = "t") -> StoredResponse:
    messages = [{"role": "user", "content": said}, {"role": "assistant", "content": said.upper()}]
    return StoredResponse.of(response_id, messages, parent, "session", tenant)


def _said(store: ResponseStore, response_id: str, tenant: str | None = "t") -> list[str] | None:
    conversation = store.get(response_id, tenant)
    return None if conversation is None else [m["content"] for m in conversation.messages]


def test_a_conversation_is_its_chain_of_turns_and_its_tenants_only() -> None:
    now = [0.0]
    store = ResponseStore(100, ttl_s=10, clock=lambda: now[0])
    store.put(_turn("r1", "a"))
    store.put(_turn("r2", "b", parent="r1"))
    assert _said(store, "r2") == ["a", "A", "b", "B"] and store.get("r2", "t").session_id == "session"
    assert _said(store, "r2", "another") is None and _said(store, "r2", None) is None
    now[0] = 8.0
    assert _said(store, "r2")  # continuing it refreshes every turn of the chain
    now[0] = 15.0
    assert _said(store, "r2") == ["a", "A", "b", "B"]  # r1 was stored at 0, last used at 8
    now[0] = 30.0
    assert _said(store, "r2") is None
    store.put(_turn("r3", "c", parent="r2"))  # its history is gone: never kept
    assert len(store) == 0 and store.bytes == 0


def test_the_lru_drops_a_conversation_whole() -> None:
    store = ResponseStore(3, ttl_s=60)
    store.put(_turn("r1", "a"))
    store.put(_turn("r2", "b", parent="r1"))
    store.put(_turn("x1", "x"))
    store.put(_turn("y1", "y"))  # over 3: r1 goes, and r2, which could never be read again, with it
    assert _said(store, "r2") is None and len(store) == 2 and _said(store, "x1") == ["x", "X"]


def test_the_store_is_bounded_in_bytes_with_large_bodies() -> None:
    """Measured, not estimated: what the store holds, in Python's own allocations."""
    bound = 1_000_000
    big = "x" * 300_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(1024, ttl_s=60, max_bytes=bound)
        for i in range(20):
            store.put(StoredResponse.of(f"r{i}", [{"role": "user", "content": big}], None, None, "t"))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.bytes <= bound and len(store) == 3 and held <= bound * 1.1
    store.put(StoredResponse.of("huge", [{"role": "user", "content": big * 4}], None, None, "t"))
    assert store.get("huge", "t") is None and len(store) == 3  # bigger than the store: never kept


@pytest.mark.slow
def test_the_shared_store_is_per_application_and_restarts_empty_when_killed(ray_cluster) -> None:
    import ray

    from cadenza.gateway.shared_store import SharedStore, store_name

    async def run() -> None:
        store = SharedStore(16, 60.0, 1 << 20, store_name("app-a", "m"))
        other = SharedStore(16, 60.0, 1 << 20, store_name("app-b", "m"))
        try:
            turns = [_turn("r1", "a"), _turn("r2", "b", parent="r1")]
            for turn in turns:
                await store.put(turn)
            assert [m["content"] for m in (await store.get("r2", "t")).messages] == ["a", "A", "b", "B"]
            assert await other.get("r1", "t") is None  # another application's store
            assert await store.stored_bytes() == sum(turn.size for turn in turns)
            killed = store.actor
            ray.kill(killed)  # for good: Ray will not restart it
            await _dead(killed)  # the kill is asynchronous: a call right after may still be answered
            assert await store.get("r2", "t") is None  # started again, empty
            await store.put(_turn("r3", "c"))
            assert await store.size() == 1 and (await store.get("r3", "t")).messages[0]["content"] == "c"
        finally:
            for s in (store, other):
                ray.kill(s.actor)

    asyncio.run(run())


async def _dead(actor: object) -> None:
    """Returns once calls to the killed actor fail (hang guard: 60 s)."""
    import ray

    for _ in range(600):
        try:
            await actor.size.remote()  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the killed store actor still answers")
