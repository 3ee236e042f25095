"""Admission control: refuse before any work starts, never after.

Counts responses in flight across the server (running in the engine or queued behind the
engine's running set) and websockets per client address.
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
        self.in_flight = 0
        self.sockets: Counter[str] = Counter()

    def try_acquire(self) -> bool:
        if self.in_flight >= self.capacity:
            return False
        self.in_flight += 1
        return True

    def acquire(self) -> None:
        """Unconditionally: a steered response's successor inherits its parent's place."""
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def open_socket(self, client: str) -> bool:
        if self.sockets[client] >= self.max_sockets_per_client:
            return False
        self.sockets[client] += 1
        return True

    def close_socket(self, client: str) -> None:
        self.sockets[client] -= 1
        if self.sockets[client] <= 0:
            del self.sockets[client]
