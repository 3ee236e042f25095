"""Gateway settings: every limit the server enforces, named, with its default and why."""

from __future__ import annotations

import hmac
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Knobs of `cadenza serve` (each is also a `--flag`, dashes for underscores).

    host/port: where to listen; loopback unless the operator asks for more.
    api_key: if set, clients must send `Authorization: Bearer <key>` on the handshake
        (browsers, which cannot set headers on a websocket, may offer the subprotocol
        `openai-insecure-api-key.<key>` instead, as OpenAI's Realtime API accepts).
    allowed_origins: Origin values accepted on websocket handshakes; empty means only the
        server's own origin. Clients that send no Origin (SDKs, curl) are not browsers and pass.
    max_frame_bytes: largest client message we read; bigger ones get an `error` event.
        Frames over 4x this are cut off by the websocket layer itself (close code 1009).
    max_concurrent_requests / max_queued_requests: responses running in the engine, and
        waiting beyond those; once both are full a new response is refused at once with
        an `error` event (code `server_overloaded`, `retry_after_ms`).
    max_responses_per_socket: responses in flight (running or queued in lanes) per socket.
    max_sockets_per_client: open websockets per client address.
    response_store_size / response_store_ttl_s: finished responses kept for
        `previous_response_id` (least recently used dropped first, and after the TTL).
    default_max_output_tokens: when a request does not say (bounded by the context).
    stream_pacing: with speculative decoding a step can bring several tokens at once; pacing
        streams them one per event, spread over the request's recent step interval, so
        readers see a steady cadence rather than bursts (never later than the next step's
        tokens arrive; whole, non-streamed HTTP answers are never paced).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_frame_bytes: int = 1 << 20
    max_concurrent_requests: int = 128
    max_queued_requests: int = 256
    max_responses_per_socket: int = 64
    max_sockets_per_client: int = 64
    response_store_size: int = 1024
    response_store_ttl_s: float = 3600.0
    default_max_output_tokens: int = 512
    stream_pacing: bool = False

    def __post_init__(self) -> None:
        positive = {
            "max_frame_bytes": self.max_frame_bytes,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_responses_per_socket": self.max_responses_per_socket,
            "max_sockets_per_client": self.max_sockets_per_client,
            "response_store_size": self.response_store_size,
            "default_max_output_tokens": self.default_max_output_tokens,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_queued_requests < 0 or self.response_store_ttl_s <= 0:
            raise ValueError("max_queued_requests must be >= 0 and response_store_ttl_s > 0")

    @property
    def own_origins(self) -> tuple[str, ...]:
        hosts = {self.host, "localhost", "127.0.0.1"} if self.host in ("127.0.0.1", "localhost") else {self.host}
        return tuple(f"http://{h}:{self.port}" for h in sorted(hosts))

    def key_accepts(self, candidates: list[str]) -> bool:
        """No key configured, or one candidate equals it (compared in constant time)."""
        if self.api_key is None:
            return True
        return any(hmac.compare_digest(c.encode(), self.api_key.encode()) for c in candidates)

    def origin_allowed(self, origin: str | None) -> bool:
        if origin is None:
            return True
        return origin in (self.allowed_origins or self.own_origins)
