"""Graceful shutdown: refuse new work, let admitted responses finish, end the rest with
their terminal event.

Left alone, uvicorn answers SIGTERM by closing every connection at once: a websocket gets
close code 1012 in the middle of a response and an SSE stream is cut without `[DONE]`.
`Drain.run` goes first (server.GatewayServer calls it): new requests get 503 and new
websockets an `error` event, admitted responses run on for up to drain_timeout_s, and the
ones still running then are ended through their engine stream, so each path sends its own
terminal event (websocket `response.failed`, SSE an error chunk then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cadenza.errors import RequestFailedError
from cadenza.gateway.admission import Admission
from cadenza.outputs import RequestOutput

# After the survivors are ended: time for their terminal events to reach the sockets.
END_GRACE_S = 5.0
POLL_S = 0.05


class ShutdownError(RequestFailedError):
    """The server ended this response because it shut down before the response finished."""


@dataclass(eq=False)
class _Live:
    task: asyncio.Task | None  # the task iterating the stream
    waiting: bool = False  # awaiting the engine's next delta: a cancel lands in the engine stream
    ended: bool = False


class Drain:
    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.draining = False  # new requests and websockets are refused
        self.ended = False  # the drain timed out: streams still running end with ShutdownError
        self.live: set[_Live] = set()

    async def track(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """`stream`, made endable by `end()`. A cancel is delivered only while the consumer waits
        on the engine (where the engine stream handles it as an abort); one that is busy sending
        instead finds `ended` when it comes back, so no write is ever cut in half."""
        live = _Live(asyncio.current_task())
        self.live.add(live)
        try:
            async with contextlib.aclosing(stream):
                while not (live.ended or self.ended):
                    live.waiting = True
                    try:
                        delta = await anext(stream)
                    except StopAsyncIteration:
                        return
                    finally:
                        live.waiting = False
                    yield delta
        except asyncio.CancelledError:
            if not live.ended:  # the client's own cancel or disconnect
                raise
            if hasattr(live.task, "uncancel"):  # 3.11+: the cancel we sent is consumed here
                live.task.uncancel()
        finally:
            self.live.discard(live)
        raise ShutdownError("the server shut down before this response finished (drain_timeout_s)")

    async def run(self, timeout_s: float) -> None:
        self.draining = True
        # Admission refuses past capacity: with none left, a new response.create on a socket
        # already open is refused too (HTTP requests never get this far while draining).
        self.admission.capacity = 0
        await self._settle(timeout_s)
        self.end()
        await self._settle(END_GRACE_S)

    def end(self) -> None:
        self.ended = True
        for live in self.live:
            live.ended = True
            if live.waiting and live.task is not None:
                live.task.cancel()

    async def _settle(self, timeout_s: float) -> None:
        """Until every admitted response has released its place, or timeout_s."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.admission.in_flight > 0:
                    await asyncio.sleep(POLL_S)
