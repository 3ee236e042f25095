"""uvicorn's HTTP protocol with deadlines on the request head and on a finished answer's drain.

uvicorn closes a keep-alive connection that sends nothing for timeout_keep_alive, but it
has no limit on a head that trickles in: a client sending one header byte a second (or
opening a connection and sending nothing) holds its connection, and one of the
limit_concurrency places, forever. Here a timer is armed whenever the connection is ready for
a request head (opened, or a response done with nothing pipelined) and disarmed once the
head is parsed; when it fires, the connection is closed.

The same protocols offer each request's app a way to drop its connection at once (a reset):
`scope["state"][ABORT_CONNECTION]`. A stream that cuts off a client that stopped reading
(send_deadline.py) needs it: uvicorn closes a connection whose response was left incomplete
with `transport.close()`, which waits for the unsent bytes to drain, and to a client that
does not read they never do (the connection, and its limit_concurrency place, stayed).

A whole (not streamed) answer has the same problem out of the app's sight: uvicorn writes its
body into the transport and the response is complete, however much of it is still unsent. So
once a response is complete the transport's unsent bytes are watched: if none of them are
taken for send_timeout_s, the connection is reset (a slow reader that makes progress is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional (uvicorn[standard]); h11 is always there
    HttpToolsProtocol = None

ABORT_CONNECTION = "cadenza.abort_connection"  # in scope["state"]: drops this request's connection


class ConnectionDeadlines:
    """Mixin over a uvicorn HTTP protocol (which provides loop, transport, connection_made...)."""

    head_timeout_s = 10.0
    send_timeout_s = 30.0
    head_timer: asyncio.TimerHandle | None = None
    drain_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        # uvicorn copies app_state into every request's scope["state"] on this connection.
        self.app_state = {**self.app_state, ABORT_CONNECTION: self.reset_connection}
        self.arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_head_timer()
        if self.drain_timer is not None:
            self.drain_timer.cancel()
        super().connection_lost(exc)

    def reset_connection(self) -> None:
        """Drops the connection at once, with a reset: its unsent bytes are discarded rather than
        left to the kernel, which would go on offering them to a client that does not read (an
        orphaned socket holding its send buffer, up to 4 MiB, for minutes)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def on_response_complete(self) -> None:
        # Armed before uvicorn's own handler, which may already parse a buffered next head
        # (and so disarm it again).
        if self.awaits_head() and not self.transport.is_closing():
            self.arm_head_timer()
        self.watch_drain(None)
        super().on_response_complete()

    def watch_drain(self, unsent_before: int | None) -> None:
        """Resets the connection if the answer's unsent bytes did not shrink in send_timeout_s
        (checked again every send_timeout_s until they are all sent). Also when uvicorn has
        closed the transport, which waits for them to drain, forever to a client that does
        not read."""
        if self.drain_timer is not None:  # a keep-alive connection's earlier answer, or this call's own timer
            self.drain_timer.cancel()
            self.drain_timer = None
        unsent = self.transport.get_write_buffer_size()
        if unsent == 0:
            return
        if unsent_before is not None and unsent >= unsent_before:
            self.reset_connection()
            return
        self.drain_timer = self.loop.call_later(self.send_timeout_s, self.watch_drain, unsent)

    def awaits_head(self) -> bool:
        return True

    def arm_head_timer(self) -> None:
        self.disarm_head_timer()
        self.head_timer = self.loop.call_later(self.head_timeout_s, self.head_timed_out)

    def disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class H11Deadlines(ConnectionDeadlines, H11Protocol):
    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # past IDLE: the head has been parsed
            self.disarm_head_timer()


if HttpToolsProtocol is not None:

    class HttpToolsDeadlines(ConnectionDeadlines, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            self.disarm_head_timer()
            super().on_headers_complete()

        def awaits_head(self) -> bool:
            return not self.pipeline  # a pipelined head is parsed already


def deadline_protocol(head_timeout_s: float, send_timeout_s: float) -> type[asyncio.Protocol]:
    """httptools' protocol when it is installed (uvicorn's own choice), else h11's, closing
    connections whose request head takes longer than head_timeout_s and resetting those whose
    finished answer is not read for send_timeout_s."""
    base: Any = HttpToolsDeadlines if HttpToolsProtocol is not None else H11Deadlines
    return type(base.__name__, (base,), {"head_timeout_s": head_timeout_s, "send_timeout_s": send_timeout_s})
