"""Gateway settings: every limit the server enforces, named, with its default and why."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from cadenza.gateway.reasoning import REASONING_PARSERS
from cadenza.gateway.scheduling import MAX_PRIORITY, MIN_PRIORITY
from cadenza.gateway.tool_calls import PARSERS

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Knobs of `cadenza serve` (each is also a `--flag`, dashes for underscores).

    host/port: where to listen; loopback unless the operator asks for more.
    api_key: if set, clients must send `Authorization: Bearer <key>` on the handshake
        (browsers, which cannot set headers on a websocket, may offer the subprotocol
        `openai-insecure-api-key.<key>` instead, as OpenAI's Realtime API accepts).
    allowed_origins: Origin values accepted on websocket handshakes; empty means only the
        server's own origin. Clients that send no Origin (SDKs, curl) are not browsers and pass.
    max_frame_bytes: largest client message we read, in bytes (UTF-8); bigger ones get an
        `error` event. Frames over 4x this are cut off by the websocket layer itself (close
        code 1009). Binary frames are answered with an `error` event, never parsed.
    max_request_bytes: largest HTTP request body, counted while it is read (413 past it).
    max_json_depth: deepest nesting of arrays/objects in a body or frame (400 / `error`).
    max_messages: messages in one chat request or response input (400 / `error`).
    max_stream_id_chars: longest websocket lane name (`stream_id`).
    max_lanes_per_socket: distinct lanes (`stream_id`s) one socket may have open at once.
    max_concurrent_requests / max_queued_requests: responses running in the engine, and
        waiting beyond those; once both are full a new response is refused at once with
        an `error` event (code `server_overloaded`, `retry_after_ms`).
    max_responses_per_socket: responses in flight (running or queued in lanes) per socket.
    max_sockets_per_client: open websockets per client (its peer address; see
        Admission.client).
    max_responses_per_client: responses in flight per client (as above), HTTP and websocket
        together; capped at one below max_concurrent_requests + max_queued_requests, so one
        client cannot take the whole server.
    allowed_hosts: `Host` header values accepted (HTTP and websocket, port optional); empty
        means the loopback names and the bound address (a DNS-rebinding guard).
    forwarded_allow_ips: proxies whose `X-Forwarded-For` / `X-Forwarded-Proto` name the
        client (uvicorn's setting of the same name; `*` trusts any peer). Empty, the default:
        those headers are ignored, since any loopback process could otherwise claim to be any
        number of clients and every per-client quota would stop binding.
    send_timeout_s: a send to a client that cannot complete in this time cancels that
        response and frees its place (a stalled reader holds nothing for long): a websocket
        is ended, an HTTP stream (SSE, a follower included) is cut and its connection dropped.
    idle_timeout_s: an HTTP keep-alive connection with no request for this long is closed.
    header_timeout_s: a connection that has not sent its whole request head in this time is
        closed (slow-header clients).
    max_connections: open connections the server accepts (uvicorn's limit_concurrency;
        past it new connections get 503).
    drain_timeout_s: on SIGTERM, how long in-flight responses may run before they are ended.
    response_store_size / response_store_ttl_s: finished responses kept for
        `previous_response_id` (least recently used dropped first, and after the TTL).
    default_max_output_tokens: when a request does not say (bounded by the context).
    stream_pacing: with speculative decoding a step can bring several tokens at once; pacing
        streams them one per event, spread over the request's recent step interval, so
        readers see a steady cadence rather than bursts (never later than the next step's
        tokens arrive; whole, non-streamed HTTP answers are never paced).
    response_log_size / response_log_ttl_s / response_log_max_events: the events of recent
        responses, kept so `GET /v1/responses/{id}?stream=true&starting_after=N` can resume a
        dropped stream: at most this many responses (the oldest finished first), each for
        this long after it ends, each keeping at most this many events (one per token, about;
        a longer response streams on but cannot be replayed).
    batch_priority: the priority of requests marked `service_tier: "flex"` (batch work);
        interactive ones run at 0, and lower runs first.
    tool_call_parser: how tool calls are read from a reply under tool_choice auto (hermes,
        llama3, mistral; auto recognises the model's format from its chat template, and takes
        hermes for a template that knows no tools, which the prompt then teaches).
    reasoning_parser: how a reasoning model's thinking is read apart from its answer (vLLM's
        flag): `qwen3` (a reply that opens with <think>) or `deepseek_r1` (a reply that starts
        inside its thinking), given as `reasoning_content` beside `content`, and counted as
        usage.completion_tokens_details.reasoning_tokens (a `reasoning` output item and
        output_tokens_details.reasoning_tokens on the Responses API). `auto`, the default:
        recognised from the chat template (gateway/reasoning.parser_for); `none`: all content.
    max_prompts_per_request: most prompts one /v1/completions request may batch (each takes its
        own admission place, as that many requests would).
    sse_keep_alive_s: an SSE stream that has sent nothing for this long (a long prefill before
        its first token) gets a `: keep-alive` comment, so a reverse proxy's read timeout does
        not cut it (0: never).
    uvicorn_log_level: uvicorn's own log level (its access log is at info), as vLLM's flag.
    metrics_prefix: the prefix of every metric at /metrics (`cadenza:ttft...`); `vllm` gives
        vLLM's exact names, so its published Grafana dashboard and alert rules match.
    log_level: Cadenza's own log level: at info, what the engine chose at load (weight format,
        kernels) and one line per request (cadenza.requests: id, tokens in and out, TTFT,
        finish reason).
    priority_api_keys: API keys whose requests may ask for a priority below the interactive 0
        (body `priority` or `x-priority`; gateway/scheduling.py); each is also accepted
        wherever api_key is. Empty, the default: no request may jump ahead of interactive
        work. Without api_key the server is open, and these keys only grant priority.
    max_prompt_cache_key_chars: longest `prompt_cache_key` (the session the engine pins),
        400 past it.
    response_log_max_bytes / response_log_max_response_bytes: the response log's events, as
        encoded JSON (what it keeps), in all and per response. Past the total the oldest
        finished responses go first; a response past its own bound, or that finds only
        running ones to evict, streams on but keeps no more events (a resume past that
        point is a 410), as past response_log_max_events.
    response_store_max_bytes: the stored conversations, as encoded JSON, least recently
        used dropped first (each stored response keeps only its own turn: its input and
        its reply; a continuation joins the turns of its chain).
    max_streams_per_client: HTTP event streams (SSE) open at once per client: streamed chat
        and completions, streamed `POST /v1/responses`, and `GET /v1/responses/{id}?stream=true`
        followers, which hold a connection but no response place; past it a 429
        (`too_many_client_streams`). Each stream's sends are bounded by send_timeout_s.
    max_grammar_bytes: the largest grammar a request may bring (response_format, text.format,
        structured_outputs, guided_*, or the one tool_choice required / a named function
        makes), in bytes of its compiled form (llguidance's serialised grammar: the schema with
        its options, the regex, the Lark text); past it a 400 (`grammar_too_large`).
    grammar_compile_timeout_s: how long a new grammar may take to compile, after admission, in
        a worker thread (never on the event loop); past it a 400 (`grammar_too_complex`), and
        the same grammar is refused at once from then on. Verdicts are cached by the grammar's
        content hash, so a repeated grammar is compiled once.
    max_grammar_requests / max_grammar_requests_per_client: sequences following a grammar in
        flight (a request with n choices counts n), server-wide and per client: each costs the
        engine's one mask thread every step. Past either a 429 (`too_many_grammar_requests`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_frame_bytes: int = 1 << 20
    max_request_bytes: int = 1 << 20
    max_json_depth: int = 32
    max_messages: int = 512
    max_stream_id_chars: int = 128
    max_lanes_per_socket: int = 16
    max_concurrent_requests: int = 128
    max_queued_requests: int = 256
    max_responses_per_socket: int = 64
    max_sockets_per_client: int = 64
    max_responses_per_client: int = 64
    allowed_hosts: tuple[str, ...] = ()
    forwarded_allow_ips: tuple[str, ...] = ()
    send_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    max_connections: int = 1024
    drain_timeout_s: float = 30.0
    response_store_size: int = 1024
    response_store_ttl_s: float = 3600.0
    default_max_output_tokens: int = 512
    stream_pacing: bool = False
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    sse_keep_alive_s: float = 15.0
    max_prompts_per_request: int = 64
    uvicorn_log_level: str = "warning"
    log_level: str = "info"
    metrics_prefix: str = "cadenza"
    batch_priority: int = 10
    response_log_size: int = 256
    response_log_ttl_s: float = 600.0
    response_log_max_events: int = 16384
    priority_api_keys: tuple[str, ...] = ()
    max_prompt_cache_key_chars: int = 256
    response_log_max_bytes: int = 128 << 20
    response_log_max_response_bytes: int = 8 << 20
    response_store_max_bytes: int = 256 << 20
    max_streams_per_client: int = 64
    max_grammar_bytes: int = 256 << 10
    grammar_compile_timeout_s: float = 2.0
    max_grammar_requests: int = 32
    max_grammar_requests_per_client: int = 8

    def __post_init__(self) -> None:
        positive = {
            "max_frame_bytes": self.max_frame_bytes,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_responses_per_socket": self.max_responses_per_socket,
            "max_sockets_per_client": self.max_sockets_per_client,
            "max_request_bytes": self.max_request_bytes,
            "max_json_depth": self.max_json_depth,
            "max_messages": self.max_messages,
            "max_prompts_per_request": self.max_prompts_per_request,
            "max_stream_id_chars": self.max_stream_id_chars,
            "max_lanes_per_socket": self.max_lanes_per_socket,
            "max_responses_per_client": self.max_responses_per_client,
            "max_connections": self.max_connections,
            "response_store_size": self.response_store_size,
            "default_max_output_tokens": self.default_max_output_tokens,
            "response_log_size": self.response_log_size,
            "response_log_max_events": self.response_log_max_events,
            "max_prompt_cache_key_chars": self.max_prompt_cache_key_chars,
            "response_log_max_response_bytes": self.response_log_max_response_bytes,
            "response_store_max_bytes": self.response_store_max_bytes,
            "max_streams_per_client": self.max_streams_per_client,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.response_log_max_bytes < self.response_log_max_response_bytes:
            raise ValueError("response_log_max_bytes must be >= response_log_max_response_bytes")
        if self.max_queued_requests < 0 or self.response_store_ttl_s <= 0:
            raise ValueError("max_queued_requests must be >= 0 and response_store_ttl_s > 0")
        for name in ("send_timeout_s", "idle_timeout_s", "header_timeout_s", "drain_timeout_s", "response_log_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.tool_call_parser not in ("auto", *PARSERS):
            choices = ", ".join(PARSERS)
            raise ValueError(f"tool_call_parser must be auto or one of {choices}, got {self.tool_call_parser!r}")
        if self.sse_keep_alive_s < 0:
            raise ValueError(f"sse_keep_alive_s must be >= 0, got {self.sse_keep_alive_s}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            message = f"metrics_prefix must be a Prometheus name (letters, digits, _), got {self.metrics_prefix!r}"
            raise ValueError(message)
        if self.log_level not in UVICORN_LOG_LEVELS[:-1]:
            raise ValueError(f"log_level must be one of {', '.join(UVICORN_LOG_LEVELS[:-1])}, got {self.log_level!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            levels = ", ".join(UVICORN_LOG_LEVELS)
            raise ValueError(f"uvicorn_log_level must be one of {levels}, got {self.uvicorn_log_level!r}")
        if self.reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
            choices = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {choices}, auto or none, got {self.reasoning_parser!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (omit it to serve without a key)")
        if isinstance(self.priority_api_keys, str) or not all(k.strip() for k in self.priority_api_keys):
            raise ValueError("priority_api_keys must be a list of non-empty keys")
        if not MIN_PRIORITY <= self.batch_priority <= MAX_PRIORITY:
            raise ValueError(f"batch_priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.batch_priority}")
        object.__setattr__(self, "priority_api_keys", tuple(self.priority_api_keys))  # a YAML list
        grammar_caps = (self.max_grammar_bytes, self.max_grammar_requests, self.max_grammar_requests_per_client)
        if min(grammar_caps) < 1 or self.grammar_compile_timeout_s <= 0:
            message = "max_grammar_bytes, max_grammar_requests(_per_client) must be >= 1, grammar_compile_timeout_s > 0"
            raise ValueError(message)

    @property
    def own_origins(self) -> tuple[str, ...]:
        hosts = {self.host, "localhost", "127.0.0.1"} if self.host in ("127.0.0.1", "localhost") else {self.host}
        return tuple(f"http://{h}:{self.port}" for h in sorted(hosts))

    @property
    def client_response_quota(self) -> int:
        """max_responses_per_client, kept below the server's capacity (concurrent + queued) so
        one client can never take every place, whatever the two settings say."""
        capacity = self.max_concurrent_requests + self.max_queued_requests
        return max(min(self.max_responses_per_client, capacity - 1), 1)

    @property
    def own_hosts(self) -> tuple[str, ...]:
        """Host header names accepted when allowed_hosts is empty."""
        return tuple(sorted({self.host, "localhost", "127.0.0.1", "[::1]"}))

    def host_allowed(self, host_header: str | None) -> bool:
        """The Host header, port stripped, is one of ours (absent: not a browser, allowed)."""
        if host_header is None:
            return True
        name = host_header.strip().lower()
        name = name[: name.index("]") + 1] if name.startswith("[") and "]" in name else name.split(":", 1)[0]
        return name in {h.lower() for h in (self.allowed_hosts or self.own_hosts)}

    def key_accepts(self, candidates: list[str]) -> bool:
        """No key configured, or one candidate equals it or a priority key (constant time)."""
        if self.api_key is None:
            return True
        return _any_equal(candidates, (self.api_key, *self.priority_api_keys))

    def grants_priority(self, candidates: list[str]) -> bool:
        """One candidate is a priority_api_keys key (compared in constant time)."""
        return _any_equal(candidates, self.priority_api_keys)

    def origin_allowed(self, origin: str | None) -> bool:
        if origin is None:
            return True
        return origin in (self.allowed_origins or self.own_origins)


def _any_equal(candidates: list[str], keys: tuple[str, ...]) -> bool:
    # Every pair is compared, so the time taken says nothing of which key (if any) matched.
    matches = [hmac.compare_digest(c.encode(), k.encode()) for c in candidates for k in keys]
    return any(matches)
