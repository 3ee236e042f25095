"""The response log of a whole Serve application: one detached Ray actor every replica mirrors its
responses' events into, so any replica can replay, follow or cancel any response, and a response
whose replica died is re-issued on a survivor.

Why a shared log and not routing by response id: Serve's router sees request metadata, not the
path's id, and a dead replica's events must outlive it anyway. Why the owner writes through
(its readers and sockets see an event only once the log holds it, shared_log's `durable`): a
client can then never be ahead of the log, so a resume anywhere has no gap; a write-behind log
would leave the survivor guessing what the client saw.

Cost: each replica flushes all its new events in one actor call (group commit: the next flush
starts when the last one is answered), so an event waits about one round trip (~1 ms), never
one call per event. The flush is also the owner's lease: a replica that has not flushed for
`response_owner_timeout_s` is dead to the log, and its unfinished responses go to the next
replica that flushes (an epoch per response fences the old owner should it come back). Cancels
from other replicas ride back on the owner's next flush (it flushes at least every
`response_log_flush_s`).

A re-issue needs the response's request and what it had produced: the create body, tenant and
priority (ReissueSpec) and the engine deltas its events came from. The survivor replays those
deltas through a fresh ResponseRun (its events up to the log's count are the same ones, so they
are not appended again) and asks its engine to go on after the emitted tokens
(`resume_from`, as a preempted request resumes): greedy and seeded requests continue token for
token; unseeded sampling continues from the same tokens with fresh randomness.
"""

from __future__ import annotations

import asyncio
import time

import ray

from cadenza.gateway.log_messages import Adoption, FlushReply, LogSlice, LogUpdate, ReissueSpec
from cadenza.gateway.response_events import ResponseEvents, ResponseLogs

ACTOR_PREFIX = "cadenza-response-log"
ADOPT_AT_ONCE = 16  # orphaned responses handed to one flush, at most
SCAN_INTERVAL_S = 0.25  # how often the log looks for orphans (it scans every unfinished log)
READ_BATCH = 512  # events per read answer, at most
TAKEN, FENCED, LOST = "taken", "fenced", "lost"


class _Entry(ResponseEvents):
    """A response in the shared log: its events, and who runs it."""

    def __init__(self, response_id: str, tenant: str | None, logs: ResponseLogs) -> None:
        super().__init__(response_id, tenant, logs)
        self.owner = ""
        self.epoch = 0
        self.spec: ReissueSpec | None = None
        self.deltas: list[bytes] = []


class _Entries(ResponseLogs):
    entry_type = _Entry


class LogBoard:
    """The shared log's state and rules (the actor is this, remote; tests use it directly)."""

    def __init__(self, bounds: tuple[int, float, int, int, int], owner_timeout_s: float) -> None:
        self.entries = _Entries(*bounds)
        self.owner_timeout_s = owner_timeout_s
        self.seen: dict[str, float] = {}  # owner -> when it last flushed
        self.cancelling: set[str] = set()  # response ids cancelled, not yet told to their owner
        self.next_scan = 0.0
        self.reissued = 0

    def flush(self, owner: str, updates: list[LogUpdate], now: float | None = None) -> FlushReply:
        now = time.monotonic() if now is None else now
        self.seen[owner] = now
        verdicts = {u.response_id: self._take(owner, u) for u in updates}
        fenced = [rid for rid, verdict in verdicts.items() if verdict == FENCED]
        lost = [rid for rid, verdict in verdicts.items() if verdict == LOST]
        cancels = [rid for rid in self.cancelling if self._owned(rid, owner)]
        self.cancelling.difference_update(cancels)
        adopted = self._adopt(owner, now) if now >= self.next_scan else []
        return FlushReply(cancels, fenced, adopted, lost)

    def leave(self, owner: str) -> None:
        """The owner stops (Serve drains it): its unfinished responses go at the next flush."""
        self.seen[owner] = float("-inf")

    async def read(self, response_id: str, tenant: str | None, after: int, wait_s: float) -> LogSlice | None:
        """Events after `after`; when there are none yet, waits up to `wait_s` for some (a long poll)."""
        entry = self.entries.get(response_id, tenant)
        if entry is None:
            return None
        if len(entry.events) <= after + 1 and not entry.done and not entry.overflowed and wait_s > 0:
            try:
                await asyncio.wait_for(entry.wait_change(), wait_s)
            except TimeoutError:
                pass
        first = after + 1
        events = entry.events[first : first + READ_BATCH]
        return LogSlice(events, first, len(entry.events), entry.done, entry.overflowed, entry.response_json)

    def cancel(self, response_id: str, tenant: str | None) -> bool:
        entry = self.entries.get(response_id, tenant)
        if entry is not None and not entry.done:
            self.cancelling.add(response_id)
        return entry is not None

    def _owned(self, response_id: str, owner: str) -> bool:
        entry = self.entries.get_any(response_id)
        return isinstance(entry, _Entry) and entry.owner == owner and not entry.done

    def _take(self, owner: str, u: LogUpdate) -> str:
        """Applies an update from the response's owner: TAKEN; FENCED: `owner` no longer owns it;
        LOST: unknown here (this log restarted empty) and the update is not whole."""
        entry = self.entries.get_any(u.response_id)
        if entry is None:
            if u.spec is None:
                return LOST
            entry = self.entries.open(u.response_id, u.spec.tenant)
            entry.owner, entry.spec, entry.epoch = owner, u.spec, u.epoch
            entry.logs.charge(entry, len(u.spec.create))  # the request is held as long as its events
        if not isinstance(entry, _Entry) or entry.owner != owner or entry.epoch != u.epoch:
            return FENCED
        for i, (kind, data) in enumerate(u.events, start=u.first):
            if i == len(entry.events) and not entry.overflowed:  # a resent flush adds nothing twice
                entry.add(kind, data, None)
        entry.count = max(entry.count, u.count)
        if u.response is not None:
            entry.add_response(u.response)
        if u.first_delta == len(entry.deltas) and not u.overflowed:
            entry.deltas += u.deltas
            entry.logs.charge(entry, sum(map(len, u.deltas)))
        entry.overflowed = entry.overflowed or u.overflowed
        if u.done and not entry.done:
            entry.finish()
        return TAKEN

    def _adopt(self, owner: str, now: float) -> list[Adoption]:
        """Up to ADOPT_AT_ONCE unfinished responses whose owner's lease ran out, now `owner`'s."""
        self.next_scan = now + SCAN_INTERVAL_S
        adopted: list[Adoption] = []
        for entry in self.entries.unfinished():
            if len(adopted) == ADOPT_AT_ONCE:
                break
            if not isinstance(entry, _Entry) or entry.spec is None or entry.owner == owner:
                continue
            if now - self.seen.get(entry.owner, float("-inf")) <= self.owner_timeout_s:
                continue
            entry.owner, entry.epoch = owner, entry.epoch + 1
            self.reissued += 1
            adopted.append(
                Adoption(
                    entry.response_id,
                    entry.epoch,
                    entry.spec,
                    list(entry.events),
                    entry.count,
                    entry.response_json,
                    list(entry.deltas),
                    entry.overflowed,
                )  # fmt: skip
            )
        return adopted


@ray.remote(num_cpus=0, max_restarts=-1)
class LogActor:
    def __init__(self, bounds: tuple[int, float, int, int, int], owner_timeout_s: float) -> None:
        self.board = LogBoard(bounds, owner_timeout_s)

    async def flush(self, owner: str, updates: list[LogUpdate]) -> FlushReply:
        return self.board.flush(owner, updates)

    async def leave(self, owner: str) -> None:
        self.board.leave(owner)

    async def read(self, response_id: str, tenant: str | None, after: int, wait_s: float) -> LogSlice | None:
        return await self.board.read(response_id, tenant, after, wait_s)

    async def cancel(self, response_id: str, tenant: str | None) -> bool:
        return self.board.cancel(response_id, tenant)

    async def stats(self) -> dict[str, int]:
        return {"responses": len(self.board.entries), "reissued": self.board.reissued}


def log_name(app_name: str, model_name: str) -> str:
    """The shared log's actor name: one per Serve application (and its model)."""
    return f"{ACTOR_PREFIX}:{app_name}:{model_name}"
