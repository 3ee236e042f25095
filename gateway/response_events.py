"""The events of recent responses, kept so a dropped stream can be resumed.

Every response (HTTP or websocket) appends its events here in order; an event's index is its
`sequence_number` within the response (what `GET /v1/responses/{id}?stream=true&starting_after=N`
counts). Readers replay what is kept and then follow the live events. Bounded: at most
`response_log_size` responses (the oldest finished ones go first), each finished one for
`response_log_ttl_s`, and each keeps at most `response_log_max_events` events (a longer
response streams on but can no longer be replayed).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

Json = dict[str, Any]


class ReplayError(LookupError):
    """The events asked for are not kept (never, or no longer)."""


class ResponseEvents:
    def __init__(self, response_id: str, max_events: int) -> None:
        self.response_id = response_id
        self.max_events = max_events
        self.events: list[Json] = []
        self.count = 0  # events appended, kept or not
        self.overflowed = False  # past max_events: the rest streams live but cannot be replayed
        self.done = False
        self.finished_at: float | None = None
        self.response: Json | None = None  # the latest response object an event carried
        self.cancel: Callable[[], None] = lambda: None  # set by the run: cancel it
        self._changed = asyncio.Event()

    def append(self, event: Json) -> Json:
        """The event with its sequence number, kept (while within max_events)."""
        numbered = {**event, "sequence_number": self.count}
        self.count += 1
        if isinstance(event.get("response"), dict):
            self.response = event["response"]
        if len(self.events) < self.max_events:
            self.events.append(numbered)
        else:
            self.overflowed = True
        self._wake()
        return numbered

    def finish(self) -> None:
        self.done, self.finished_at = True, time.monotonic()
        self._wake()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[Json]:
        """The kept events after `starting_after`, then the live ones until the response ends."""
        if starting_after != -1 and not 0 <= starting_after < len(self.events):
            raise ReplayError(f"starting_after {starting_after} is not among this response's kept events")
        at = starting_after + 1
        while True:
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.overflowed:
                raise ReplayError("this response has more events than response_log_max_events keeps")
            if self.done:
                return
            await self._changed.wait()

    async def wait_for(self, count: int) -> None:
        """Until `count` events were appended (kept or not) or the response ended."""
        while self.count < count and not self.done:
            await self._changed.wait()

    async def wait_done(self) -> None:
        while not self.done:
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class ResponseLogs:
    def __init__(self, max_size: int, ttl_s: float, max_events: int) -> None:
        self.max_size, self.ttl_s, self.max_events = max_size, ttl_s, max_events
        self._items: OrderedDict[str, ResponseEvents] = OrderedDict()

    def open(self, response_id: str) -> ResponseEvents:
        self._expire()
        log = self._items[response_id] = ResponseEvents(response_id, self.max_events)
        while len(self._items) > self.max_size:  # the oldest finished first; running ones stay
            oldest = next((k for k, v in self._items.items() if v.done), None)
            if oldest is None:
                break
            del self._items[oldest]
        return log

    def get(self, response_id: str) -> ResponseEvents | None:
        self._expire()
        return self._items.get(response_id)

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [
            k for k, v in self._items.items() if v.finished_at is not None and now - v.finished_at > self.ttl_s
        ]:
            del self._items[key]
