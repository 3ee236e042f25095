"""A Serve replica's side of the shared response log (shared_log.py): its own responses' logs,
mirrored there by one flusher, and the other replicas' responses, read from there.

The local log stays the one its run writes and its local readers follow; `durable` (how many
events the shared log acknowledged) is as far as they read. An adoption (a dead replica's
response handed here) is given to `on_adopt`, which re-issues it (responses_http.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray

from cadenza.gateway.log_messages import Adoption, FlushReply, LogSlice, LogUpdate, ReissueSpec, encode_delta
from cadenza.gateway.named_actor import NamedActorClient
from cadenza.gateway.response_events import OVERFLOWED, Json, Kept, ReplayError, ResponseEvents, ResponseLogs
from cadenza.gateway.shared_log import LogActor

log = logging.getLogger(__name__)

READ_WAIT_S = 10.0  # a remote reader's long poll: the actor answers sooner when events come
LEAVE_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 10.0  # a flush unanswered this long counts as failed


class SharedLogClient(NamedActorClient):
    def __init__(self, name: str, bounds: tuple[int, float, int, int, int], owner_timeout_s: float) -> None:
        self.args = (bounds, owner_timeout_s)
        super().__init__(name)

    def _connect(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        options = LogActor.options(name=self.name, lifetime="detached", get_if_exists=True)
        return options.remote(*self.args)

    async def flush(self, owner: str, updates: list[LogUpdate]) -> FlushReply:
        return await self._call("flush", owner, updates)

    async def read(self, response_id: str, tenant: str | None, after: int, wait_s: float) -> LogSlice | None:
        return await self._call("read", response_id, tenant, after, wait_s)

    def cancel_soon(self, response_id: str, tenant: str | None) -> None:
        """Sent now, not awaited (Ray keeps one caller's calls to an actor in order)."""
        self.actor.cancel.remote(response_id, tenant)

    def leave(self, owner: str) -> None:
        """From a stopping replica's __del__ (no loop to await on): bounded, failures ignored."""
        with contextlib.suppress(Exception):
            ray.get(self.actor.leave.remote(owner), timeout=LEAVE_TIMEOUT_S)


@dataclass(eq=False)
class _Mirror:
    """What the shared log acknowledged of one local response (all of it kept here, so a log
    that restarted empty gets it again whole)."""

    epoch: int
    spec: ReissueSpec
    send_spec: bool = True  # with the first update (and a resend after the log restarted)
    events: int = 0
    response: bytes = b""
    deltas: list[bytes] = field(default_factory=list)
    deltas_sent: int = 0


class MirroredLogs(ResponseLogs):
    shared = True

    def __init__(self, bounds: tuple[int, float, int, int, int], client: SharedLogClient, owner: str, flush_s: float):
        super().__init__(*bounds)
        self.client, self.owner, self.flush_s = client, owner, flush_s
        self.mirrors: dict[ResponseEvents, _Mirror] = {}
        self.dirty: dict[ResponseEvents, None] = {}  # ordered set
        self.on_adopt: Callable[[Adoption], None] = lambda adoption: None
        self.reissued = 0
        self.early_cancels: set[str] = set()  # cancels for adopted responses not yet re-issued
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def open(self, response_id: str, tenant: str | None = None, spec: Any = None) -> ResponseEvents:  # noqa: ANN401
        entry = super().open(response_id, tenant)
        if spec is not None:
            self.start()  # normally running since the replica's first health check
            entry.durable = 0
            self.mirrors[entry] = _Mirror(0, spec)
            self.changed(entry)
        return entry

    def restore(self, adoption: Adoption) -> ResponseEvents:
        """The local log of a response re-issued here: its events so far, as the shared log kept them."""
        entry = super().open(adoption.response_id, adoption.spec.tenant)
        for kind, data in adoption.events:
            entry.add(kind, data, None)
        entry.count, entry.overflowed = adoption.count, adoption.overflowed
        entry.add_response(adoption.response)
        entry.durable = len(entry.events)
        self.mirrors[entry] = _Mirror(
            adoption.epoch, adoption.spec, False, len(entry.events), adoption.response,
            list(adoption.deltas), len(adoption.deltas),
        )  # fmt: skip
        self.reissued += 1
        return entry

    def take_cancel(self, response_id: str) -> bool:
        """Whether a cancel came for this adopted response before its re-issue started."""
        if response_id in self.early_cancels:
            self.early_cancels.discard(response_id)
            return True
        return False

    def changed(self, entry: ResponseEvents) -> None:
        if entry in self.mirrors:
            self.dirty[entry] = None
            self._kick.set()

    def record(self, entry: ResponseEvents, delta: Any) -> None:  # noqa: ANN401
        mirror = self.mirrors.get(entry)
        if mirror is not None and not entry.overflowed:
            mirror.deltas.append(encode_delta(delta))

    def start(self) -> None:
        """Starts the flusher (on the replica's loop; idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush_forever())

    async def fetch(self, response_id: str, tenant: str | None) -> RemoteLog | None:
        """Another replica's response, as the shared log holds it (None: not there, or not the tenant's)."""
        first = await self.client.read(response_id, tenant, -1, 0.0)
        return None if first is None else RemoteLog(self.client, response_id, tenant, first)

    async def _flush_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.flush_s)  # at least every flush_s: the lease
            self._kick.clear()
            try:
                await self.flush_once()
            except Exception:  # those responses go on unmirrored; the next ones try again
                log.warning("flushing to the shared response log failed", exc_info=True)
                await asyncio.sleep(self.flush_s)

    async def flush_once(self) -> None:
        entries = list(self.dirty)
        self.dirty.clear()
        updates = [self._update(entry) for entry in entries]
        try:
            reply = await asyncio.wait_for(self.client.flush(self.owner, updates), FLUSH_TIMEOUT_S)
        except asyncio.CancelledError:
            self.dirty.update(dict.fromkeys(entries))
            raise
        except Exception:
            self._unmirror(entries)
            raise
        lost = set(reply.lost)
        for entry, update in zip(entries, updates, strict=True):
            self._acknowledged(entry, update, lost)
        self._apply(reply)

    def _update(self, entry: ResponseEvents) -> LogUpdate:
        m = self.mirrors[entry]
        response = entry.response_json
        return LogUpdate(
            entry.response_id, m.epoch, m.events, entry.events[m.events :], entry.count,
            response if response != m.response else None, m.deltas_sent, m.deltas[m.deltas_sent :],
            entry.overflowed, entry.done, m.spec if m.send_spec else None,
        )  # fmt: skip

    def _unmirror(self, entries: list[ResponseEvents]) -> None:
        """The shared log did not answer (named_actor already retried once on a fresh actor):
        these responses go on as on one gateway, readable here only, rather than keep their
        clients waiting on a log that may not come back."""
        for entry in entries:
            self.mirrors.pop(entry, None)
            entry.durable = None
            entry.notify()

    def _acknowledged(self, entry: ResponseEvents, u: LogUpdate, lost: set[str]) -> None:
        m = self.mirrors.get(entry)
        if m is None:
            return
        if u.response_id in lost:  # sent again, whole, at the next flush
            m.send_spec, m.events, m.response, m.deltas_sent = True, 0, b"", 0
            self.changed(entry)
            return
        m.send_spec = False
        m.events = u.first + len(u.events)
        m.response = u.response if u.response is not None else m.response
        m.deltas_sent += len(u.deltas)
        entry.durable = max(entry.durable or 0, m.events)
        entry.notify()
        if u.done:
            del self.mirrors[entry]

    def _apply(self, reply: FlushReply) -> None:
        by_id = {entry.response_id: entry for entry in self.mirrors}
        for rid in reply.cancels:
            if (entry := by_id.get(rid)) is not None:
                entry.cancel()
            else:  # a response adopted here whose re-issue has not started yet
                self.early_cancels.add(rid)
        for rid in reply.fenced:  # re-issued elsewhere: stop here, quietly
            if (entry := by_id.get(rid)) is not None:
                entry.moved = True
                self.mirrors.pop(entry, None)
                entry.cancel()
                entry.notify()
        for adoption in reply.adopted:
            self.on_adopt(adoption)


class RemoteLog:
    """Another replica's response, read from the shared log (ResponseEvents' reader surface)."""

    def __init__(self, client: SharedLogClient, response_id: str, tenant: str | None, first: LogSlice) -> None:
        self.client, self.response_id, self.tenant = client, response_id, tenant
        self.last = first

    @property
    def response(self) -> Json | None:
        return msgspec.json.decode(self.last.response) if self.last.response else None

    @property
    def kept(self) -> int:
        return self.last.kept

    async def follow(self, starting_after: int = -1) -> AsyncIterator[Kept]:
        if starting_after != -1 and not 0 <= starting_after < self.kept:
            raise ReplayError(f"starting_after {starting_after} is not among this response's kept events")
        at = starting_after
        while True:
            got = await self._read(at, READ_WAIT_S)
            for event in got.events:
                yield event
            at += len(got.events)
            if at + 1 < got.kept:
                continue
            if got.overflowed:
                raise ReplayError(OVERFLOWED)
            if got.done:
                return

    def cancel(self) -> None:
        """Its owner hears of it on its next flush."""
        self.client.cancel_soon(self.response_id, self.tenant)

    async def wait_done(self) -> None:
        while not self.last.done:
            await self._read(self.last.kept - 1, READ_WAIT_S)

    async def _read(self, after: int, wait_s: float) -> LogSlice:
        got = await self.client.read(self.response_id, self.tenant, after, wait_s)
        if got is None:
            raise ReplayError(f"response {self.response_id!r} is no longer kept")
        self.last = got
        return got
