"""Admission control: refuse before any work starts, never after.

Counts responses in flight across the server (running in the engine or queued behind the
engine's running set) and per client (HTTP and websocket together), and websockets and
HTTP event streams per client. A client is its peer address (see Admission.client).
"""

from __future__ import annotations

from collections import Counter

from cadenza.gateway.settings import GatewaySettings

# Retry hint sent with `server_overloaded`: roughly one short reply's worth of time.
RETRY_AFTER_MS = 1000
# The same hint as HTTP's Retry-After header (whole seconds, at least one).
RETRY_AFTER = {"Retry-After": str(max(1, RETRY_AFTER_MS // 1000))}


class Admission:
    def __init__(self, settings: GatewaySettings) -> None:
        self.capacity = settings.max_concurrent_requests + settings.max_queued_requests
        self.max_sockets_per_client = settings.max_sockets_per_client
        self.max_responses_per_client = settings.client_response_quota
        self.max_streams_per_client = settings.max_streams_per_client
        self.in_flight = 0
        self.responses: Counter[str] = Counter()  # client -> responses in flight
        self.sockets: Counter[str] = Counter()
        self.streams: Counter[str] = Counter()  # client -> HTTP event streams open

    def client(self, address: str | None) -> str:
        """Whose quota a request counts against: its peer address (a proxy's X-Forwarded-For
        counts only from forwarded_allow_ips). A presented key never names a client: on a keyed
        server every admitted client holds the one key, so it tells no one apart, and a made-up
        key (sent before the real one, or to a server without keys) would give one process a
        fresh quota per request or per socket."""
        return f"addr:{address or 'unknown'}"

    def try_acquire(self, client: str) -> bool:
        if self.in_flight >= self.capacity or self.responses[client] >= self.max_responses_per_client:
            return False
        self.acquire(client)
        return True

    def refusal(self, client: str) -> tuple[str, str]:
        """(code, message) for the 429 after try_acquire refused `client`."""
        if self.in_flight >= self.capacity:
            return "server_overloaded", "the server is at capacity; retry shortly"
        message = f"this client already has {self.responses[client]} responses in flight (max_responses_per_client)"
        return "too_many_client_responses", message

    def acquire(self, client: str) -> None:
        """Unconditionally: a steered response's successor inherits its parent's place."""
        self.in_flight += 1
        self.responses[client] += 1

    def release(self, client: str) -> None:
        self.in_flight -= 1
        self.responses[client] -= 1
        assert self.in_flight >= 0 and self.responses[client] >= 0, f"{client} released more than it held"
        if not self.responses[client]:  # forget idle clients: the counter must not grow forever
            del self.responses[client]

    def check_invariants(self) -> None:
        """For the tests (it walks every client)."""
        assert self.in_flight >= 0 and self.in_flight == sum(self.responses.values()), (self.in_flight, self.responses)

    def open_socket(self, client: str) -> bool:
        if self.sockets[client] >= self.max_sockets_per_client:
            return False
        self.sockets[client] += 1
        return True

    def close_socket(self, client: str) -> None:
        self.sockets[client] -= 1
        if self.sockets[client] <= 0:
            del self.sockets[client]

    def admit(self, client: str, stream: bool) -> tuple[str, str] | None:
        """A response place for an HTTP request of `client`, and a stream when it streams: None
        once both are held (give both back with give_back), else (code, message) for the 429."""
        if stream and not self.open_stream(client):
            return self.stream_refusal(client)
        if not self.try_acquire(client):
            if stream:
                self.close_stream(client)
            return self.refusal(client)
        return None

    def give_back(self, client: str, stream: bool) -> None:
        self.release(client)
        if stream:
            self.close_stream(client)

    def open_stream(self, client: str) -> bool:
        """An HTTP event stream (SSE, a follower included): each holds a connection until it ends."""
        if self.streams[client] >= self.max_streams_per_client:
            return False
        self.streams[client] += 1
        return True

    def stream_refusal(self, client: str) -> tuple[str, str]:
        """(code, message) for the 429 after open_stream refused `client`."""
        message = f"this client already has {self.streams[client]} streams open (max_streams_per_client)"
        return "too_many_client_streams", message

    def close_stream(self, client: str) -> None:
        self.streams[client] -= 1
        assert self.streams[client] >= 0, f"{client} closed more streams than it opened"
        if not self.streams[client]:
            del self.streams[client]
