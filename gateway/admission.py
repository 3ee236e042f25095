"""Admission control: refuse before any work starts, never after.

Counts responses in flight across the server (running in the engine or queued behind the
engine's running set) and per client (HTTP and websocket together), and websockets per
client. A client is its peer address (see Admission.client).
"""

from __future__ import annotations

from collections import Counter

from cadenza.gateway.settings import GatewaySettings

# Retry hint sent with `server_overloaded`: roughly one short reply's worth of time.
RETRY_AFTER_MS = 1000


class Admission:
    def __init__(self, settings: GatewaySettings) -> None:
        self.capacity = settings.max_concurrent_requests + settings.max_queued_requests
        self.max_sockets_per_client = settings.max_sockets_per_client
        self.max_responses_per_client = settings.client_response_quota
        self.in_flight = 0
        self.responses: Counter[str] = Counter()  # client -> responses in flight
        self.sockets: Counter[str] = Counter()

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
