"""Every streamed response's sends, bounded by send_timeout_s: SSE over HTTP and the websocket.

uvicorn's send waits while the transport is over its high-water mark, which it stays for as
long as the client does not read; without a deadline a client that stops reading holds its
response (its engine request, its admission place) and its connection for good. A send that
is not taken in time ends the stream: the websocket ends its socket (responses_ws.py); an SSE
stream closes its body (which aborts the engine request), runs its `on_close` (which gives
its places back) and aborts the connection, whose unsent bytes would otherwise keep it open
(a transport closes only once its buffer drains, and this one never drains).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cadenza.gateway.connection_deadlines import ABORT_CONNECTION

log = logging.getLogger(__name__)


class SendTimeout(TimeoutError):
    """The client did not take a send within send_timeout_s."""


async def send_within(sending: Awaitable[None], timeout_s: float) -> None:
    """Awaits one send, or raises SendTimeout (the send cancelled) after timeout_s. NOTE: not
    asyncio.wait_for: on Python 3.11 it loses a cancel that arrives as the send completes, and
    the cancelled response then streams on to its end into a closed socket (seen: a closed
    socket's response held its place and KV for its whole length). asyncio.wait never
    swallows the caller's cancel."""
    task = asyncio.ensure_future(sending)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise SendTimeout(f"the client took no data for {timeout_s} s (send_timeout_s)")
    task.result()


def drop_connection(scope: Scope) -> bool:
    """Resets the connection of `scope` at once, where the server offers that (connection_deadlines'
    protocols do, for HTTP and for websockets upgraded from them; Ray Serve's proxy does not).
    Whether it did."""
    abort = scope.get("state", {}).get(ABORT_CONNECTION)
    if abort is not None:
        abort()
    return abort is not None


# A reverse proxy must pass events on as they come: not cache them, not buffer them (nginx).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic


class SseStream(StreamingResponse):
    """A text/event-stream response whose every send is bounded by `timeout_s`, and which ends
    its body and runs `on_close` however it ends: completed, the client gone (before the
    first chunk included: a never-started generator runs no `finally`, which once leaked a
    place for good), this task cancelled, or a send not taken in time. After keep_alive_s
    without an event (a long prefill before the first token) it sends a comment, so a proxy's
    read timeout does not cut the stream."""

    def __init__(
        self,
        chunks: AsyncGenerator[str | bytes, None],
        timeout_s: float,
        on_close: Callable[[], Any],
        headers: dict[str, str] | None = None,
        keep_alive_s: float | None = None,
    ) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self.chunks, self.timeout_s, self.on_close = chunks, timeout_s, on_close
        self.keep_alive_s = keep_alive_s or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(_disconnect(receive))
        sending = asyncio.ensure_future(self._send_all(send))
        left = False
        try:
            await asyncio.wait({gone, sending}, return_when=asyncio.FIRST_COMPLETED)
            left = gone.done()
            if not left and _timed_out(sending):
                await self._abort(scope, gone)
        finally:  # also when this task is cancelled (a drain, or Serve's proxy on a disconnect)
            gone.cancel()
            sending.cancel()
            try:
                await asyncio.wait({sending})  # its own `finally` closes the body
            finally:
                self.on_close()
        if sending.cancelled():
            return
        error = sending.exception()  # retrieved in every case: asyncio logs one never looked at
        # OSError: a server on ASGI spec 2.4 reports a client gone by failing its send.
        if error is not None and not left and not isinstance(error, (SendTimeout, OSError)):
            raise error  # the body's own failure, as StreamingResponse would raise it

    async def _send_all(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        pending: asyncio.Future[str | bytes] | None = None  # the next chunk, being produced
        try:
            await send_within(send(start), self.timeout_s)
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(self.chunks.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=self.keep_alive_s)
                if not done:  # nothing to send for keep_alive_s: the same chunk is awaited on
                    await self._send_data(send, KEEP_ALIVE)
                    continue
                produced, pending = pending, None
                try:
                    chunk = produced.result()
                except StopAsyncIteration:
                    break
                await self._send_data(send, chunk if isinstance(chunk, bytes) else chunk.encode(self.charset))
            await send_within(send({"type": "http.response.body", "body": b"", "more_body": False}), self.timeout_s)
        finally:  # now, not at garbage collection: closing the body aborts its engine request
            if pending is not None:  # a generator mid-step cannot be closed: stop the step first
                pending.cancel()
                await asyncio.wait({pending})
            await self.chunks.aclose()

    async def _send_data(self, send: Send, data: bytes) -> None:
        await send_within(send({"type": "http.response.body", "body": data, "more_body": True}), self.timeout_s)

    async def _abort(self, scope: Scope, gone: asyncio.Future[None]) -> None:
        """Drops the connection, when the server offers that (connection_deadlines' protocols do;
        otherwise it closes the connection once this returns with the response incomplete)."""
        log.warning("HTTP client %s took no data for send_timeout_s; its stream is cut", scope.get("client"))
        if drop_connection(scope):
            # Until uvicorn has seen the connection lost: returning sooner logs the response
            # as incomplete.
            await asyncio.wait({gone}, timeout=self.timeout_s)


def _timed_out(sending: asyncio.Future[None]) -> bool:
    return sending.done() and not sending.cancelled() and isinstance(sending.exception(), SendTimeout)


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the request body was read before the stream began)."""
    while (await receive())["type"] != "http.disconnect":
        pass
