"""The events of recent responses, kept so a dropped stream can be resumed.

Every response (HTTP or websocket) appends its events here in order; an event's index is its
`sequence_number` within the response (what `GET /v1/responses/{id}?stream=true&starting_after=N`
counts). Readers replay what is kept and then follow the live events.

A log belongs to its tenant (state.tenant_salt: the API key and the client's cache_salt); a
lookup by another tenant finds nothing, exactly as for an id never issued.

Bounded by count and by bytes: at most `response_log_size` responses (the oldest finished ones
go first), each finished one for `response_log_ttl_s`; each keeps at most
`response_log_max_events` events and `response_log_max_response_bytes`, all together at most
`response_log_max_bytes`. Events are kept as their encoded JSON, so the bytes counted are the
bytes held (as Python dicts a token's event took ~5x its JSON; each event's own overhead is
counted too). A response past its bounds
streams on but can no longer be replayed from there; its latest response object (what GET
returns) is always kept.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

Json = dict[str, Any]
Kept = tuple[str, bytes]  # an event's type and its JSON (sequence_number included)
# Per kept event besides its JSON: the tuple, the bytes header, the list slot (sys.getsizeof: 97).
EVENT_OVERHEAD_BYTES = 100


def _encode(value: Any) -> bytes:
    """JSON held exactly: msgspec leaves its output with up to half as much again allocated
    (measured with tracemalloc), which a copy drops."""
    return bytes(memoryview(msgspec.json.encode(value)))


class ReplayError(LookupError):
    """The events asked for are not kept (never, or no longer)."""


OVERFLOWED = (
    "this response has more events than the response log keeps "
    "(response_log_max_events, response_log_max_response_bytes, response_log_max_bytes)"
)
MOVED = "this response was re-issued on another replica: resume it with GET /v1/responses/{id}?stream=true"


def _no_cancel() -> None:
    return None


class ResponseEvents:
    def __init__(self, response_id: str, tenant: str | None, logs: ResponseLogs) -> None:
        self.response_id = response_id
        self.tenant = tenant  # whose response this is: only its tenant finds it
        self.logs = logs  # whose byte budget this log draws on
        self.events: list[Kept] = []
        self.bytes = 0  # kept here: events and the response object, as encoded JSON
        self.count = 0  # events appended, kept or not
        self.overflowed = False  # past a bound: the rest streams live but cannot be replayed
        self.done = False
        self.finished_at: float | None = None
        self._response = b""  # the latest response object an event carried, as JSON
        # Set by the run: cancel it. Reset when the run ends, so a finished log does not hold
        # the run (its prompt ids, messages and request) alive for its TTL.
        self.cancel: Callable[[], None] = _no_cancel
        # Under Serve (shared_log.MirroredLogs): how many kept events the application's shared
        # log holds; readers here see no further, so no client is ever ahead of the shared log.
        # None: every kept event is readable (one gateway).
        self.durable: int | None = None
        self.moved = False  # re-issued elsewhere (shared_log): this replica's copy stops here
        self._changed = asyncio.Event()

    @property
    def response(self) -> Json | None:
        return msgspec.json.decode(self._response) if self._response else None

    @property
    def kept(self) -> int:
        """Events a reader may replay from here: kept, and held by the shared log if there is one."""
        return len(self.events) if self.durable is None else min(self.durable, len(self.events))

    @property
    def response_json(self) -> bytes:
        return self._response

    def append(self, event: Json) -> Json:
        """The event with its sequence number, kept while within the bounds."""
        numbered = {**event, "sequence_number": self.count}
        if self.moved:  # its run goes on elsewhere: nothing more is kept or shown here
            return numbered
        response = _encode(event["response"]) if isinstance(event.get("response"), dict) else None
        self.add(event["type"], None if self.overflowed else _encode(numbered), response)
        return numbered

    def add(self, kind: str, data: bytes | None, response: bytes | None) -> None:
        """One numbered event as JSON (None: past the bounds), and the response object it carried."""
        self.count += 1
        if response is not None:
            self.add_response(response)
        if data is None:
            self.overflowed = True
        elif not self.overflowed:
            if len(self.events) < self.logs.max_events and self.logs.reserve(self, len(data) + EVENT_OVERHEAD_BYTES):
                self.events.append((kind, data))
            else:  # never kept again: a replay must not skip what was dropped
                self.overflowed = True
        self._wake()

    def add_response(self, response: bytes) -> None:
        """The latest response object (what GET returns), always kept."""
        self.logs.charge(self, len(response) - len(self._response))
        self._response = response
        self._wake()

    def record(self, delta: Any) -> None:  # noqa: ANN401 - the engine's RequestOutput
        """An engine delta this response's events come from (kept where a re-issue may need it)."""
        self.logs.record(self, delta)

    def finish(self) -> None:
        self.done, self.finished_at = True, time.monotonic()
        self.cancel = _no_cancel
        self._wake()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[Kept]:
        """The kept events after `starting_after`, then the live ones until the response ends."""
        if starting_after != -1 and not 0 <= starting_after < self.kept:
            raise ReplayError(f"starting_after {starting_after} is not among this response's kept events")
        at = starting_after + 1
        while True:
            while at < self.kept:
                yield self.events[at]
                at += 1
            if self.moved:
                raise ReplayError(MOVED)
            if self.overflowed and at >= len(self.events):
                raise ReplayError(OVERFLOWED)
            if self.done and at >= len(self.events):
                return
            await self._changed.wait()

    async def wait_for(self, count: int) -> None:
        """Until `count` events were appended (kept or not) or the response ended."""
        while self.count < count and not self.done:
            await self._changed.wait()

    async def wait_done(self) -> None:
        while not self.done:
            await self._changed.wait()

    async def wait_durable(self, count: int) -> None:
        """Until the shared log holds `count` events (or nothing more will be): a socket shows
        an event only then, so a resume on any replica finds what its client saw."""
        while self.durable is not None and self.durable < min(count, len(self.events)) and not self.moved:
            await self._changed.wait()

    async def wait_change(self) -> None:
        await self._changed.wait()

    def notify(self) -> None:
        """Wakes the readers only (the shared log took more events)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self.notify()
        self.logs.changed(self)


class ResponseLogs:
    shared = False  # shared_log.MirroredLogs: every replica's runs mirrored to one log
    entry_type = ResponseEvents

    def __init__(
        self,
        max_size: int,
        ttl_s: float,
        max_events: int,
        max_bytes: int = 128 << 20,
        max_response_bytes: int = 8 << 20,
    ) -> None:
        self.max_size, self.ttl_s, self.max_events = max_size, ttl_s, max_events
        self.max_bytes, self.max_response_bytes = max_bytes, max_response_bytes
        self.bytes = 0  # kept by the logs in _items
        self._items: OrderedDict[str, ResponseEvents] = OrderedDict()

    def open(self, response_id: str, tenant: str | None = None, spec: Any = None) -> ResponseEvents:  # noqa: ANN401
        """A new response's log; spec: what re-issues it elsewhere (shared_log.ReissueSpec), or None."""
        self._expire()
        log = self._items[response_id] = self.entry_type(response_id, tenant, self)
        while len(self._items) > self.max_size and self._drop_oldest_finished(log):
            pass
        return log

    def changed(self, log: ResponseEvents) -> None:
        """Hook: `log` has a new event or ended."""

    def record(self, log: ResponseEvents, delta: Any) -> None:  # noqa: ANN401
        """Hook: an engine delta of `log`'s response (kept only where responses can be re-issued)."""

    def get(self, response_id: str, tenant: str | None = None) -> ResponseEvents | None:
        """The tenant's log of that response; another tenant's is not found, as an unknown id."""
        self._expire()
        log = self._items.get(response_id)
        return log if log is not None and log.tenant == tenant else None

    def get_any(self, response_id: str) -> ResponseEvents | None:
        """Whoever's it is (the shared log's owners; never a client's lookup)."""
        self._expire()
        return self._items.get(response_id)

    def unfinished(self) -> list[ResponseEvents]:
        return [log for log in self._items.values() if not log.done]

    def reserve(self, log: ResponseEvents, size: int) -> bool:
        """Room for `size` more bytes of events in `log`: within its own bound, and within the
        total once the oldest finished logs have gone (running ones are never dropped)."""
        if log.bytes + size > self.max_response_bytes:
            return False
        while self.bytes + size > self.max_bytes and self._drop_oldest_finished(log):
            pass
        if self.bytes + size > self.max_bytes:
            return False
        self.charge(log, size)
        return True

    def charge(self, log: ResponseEvents, size: int) -> None:
        """Counts bytes `log` keeps whatever the bounds (its latest response object), making room
        by dropping the oldest finished logs: only running logs' response objects may exceed
        the total, by one response object each."""
        log.bytes += size
        if self._items.get(log.response_id) is log:
            self.bytes += size
        while self.bytes > self.max_bytes and self._drop_oldest_finished(log):
            pass

    def __len__(self) -> int:
        return len(self._items)

    def _drop_oldest_finished(self, keep: ResponseEvents) -> bool:
        oldest = next((k for k, v in self._items.items() if v.done and v is not keep), None)
        if oldest is not None:
            self._drop(oldest)
        return oldest is not None

    def _drop(self, response_id: str) -> None:
        self.bytes -= self._items.pop(response_id).bytes

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [
            k for k, v in self._items.items() if v.finished_at is not None and now - v.finished_at > self.ttl_s
        ]:
            self._drop(key)
