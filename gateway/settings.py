"""Gateway settings: every limit the server enforces, named, with its default and why."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from cadenza.gateway.log_format import LOG_FORMATS
from cadenza.gateway.reasoning import REASONING_PARSERS
from cadenza.gateway.scheduling import MAX_PRIORITY, MIN_PRIORITY
from cadenza.gateway.tool_calls import PARSERS
from cadenza.setting import setting

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Knobs of `cadenza serve` (each is also a `--flag`, dashes for underscores). Each field's
    doc is its line in docs/settings.md and its --help text (cadenza/setting.py)."""

    # network
    host: str = setting("127.0.0.1", "network", "where to listen (loopback unless you ask)")
    port: int = setting(8000, "network", "the port to listen on")
    allowed_origins: tuple[str, ...] = setting(
        (),
        "network",
        "Origins accepted from browsers (HTTP and websocket); clients sending no Origin (SDKs, curl) pass; origins "
        "named here also get CORS headers (their preflights answered)",
        default_text="the server's own",
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        "network",
        "`Host` header values accepted (port optional), a DNS-rebinding guard",
        default_text="loopback names and --host",
    )
    forwarded_allow_ips: tuple[str, ...] = setting(
        (),
        "network",
        "proxies whose `X-Forwarded-For` / `X-Forwarded-Proto` name the client (`*`: any peer). None by default: "
        "any loopback process could otherwise claim to be any number of clients",
        default_text="none",
    )
    max_connections: int = setting(1024, "network", "open connections accepted (past it new ones get 503)")
    send_timeout_s: float = setting(
        30.0,
        "network",
        "a send to a client that cannot complete in this time cancels that response and frees its place (a "
        "websocket is ended, an HTTP stream cut)",
    )
    idle_timeout_s: float = setting(5.0, "network", "an HTTP keep-alive connection idle this long is closed")
    header_timeout_s: float = setting(
        10.0, "network", "a connection that has not sent its whole request head in this time is closed"
    )
    drain_timeout_s: float = setting(30.0, "network", "on SIGTERM, how long in-flight responses may run before ending")
    sse_keep_alive_s: float = setting(
        15.0,
        "network",
        "an SSE stream silent this long (a long prefill) gets a `: keep-alive` comment, so a proxy's read timeout "
        "does not cut it (0: never)",
    )
    # security
    api_key: str | None = setting(
        None,
        "security",
        "require `Authorization: Bearer KEY` on every endpoint but `/` (and its scripts), `/health`, `/ping`, "
        "`/version`, `/openapi.json` and `/docs`, and on the websocket handshake (browsers: subprotocol "
        "`openai-insecure-api-key.KEY`); compared in constant time",
        env="CADENZA_API_KEY",
        default_text="$CADENZA_API_KEY",
    )
    tenant_api_keys: tuple[str, ...] = setting(
        (),
        "security",
        "more keys, each accepted wherever `api_key` is and each its own tenant: its responses, stored turns, session "
        "pins, prefix cache and per-client quotas are apart from every other key's (a shared `api_key` is one tenant)",
        default_text="none",
    )
    priority_api_keys: tuple[str, ...] = setting(
        (),
        "security",
        "keys whose requests may ask for a priority below the interactive 0 (body `priority` or `x-priority`); each "
        "is also accepted wherever `api_key` is",
        default_text="none",
    )
    # request limits
    max_frame_bytes: int = setting(
        1 << 20,
        "input limits",
        "largest websocket message read (UTF-8 bytes): bigger ones get `frame_too_large`; over 4x, the socket closes "
        "(1009)",
        default_text="1 MiB",
    )
    max_request_bytes: int = setting(
        1 << 20, "input limits", "largest HTTP request body, counted while it is read (413)", default_text="1 MiB"
    )
    max_json_depth: int = setting(32, "input limits", "deepest nesting of arrays and objects in a body or frame")
    max_messages: int = setting(512, "input limits", "messages in one chat request or response input")
    max_prompts_per_request: int = setting(
        64, "input limits", "prompts one `/v1/completions` request may batch (each takes its own admission place)"
    )
    max_stream_id_chars: int = setting(128, "input limits", "longest websocket lane name (`stream_id`)")
    max_prompt_cache_key_chars: int = setting(
        256, "input limits", "longest `prompt_cache_key` (the session the engine pins)"
    )
    max_grammar_bytes: int = setting(
        256 << 10,
        "input limits",
        "largest grammar a request may bring (response_format, structured_outputs, a tool_choice's), in bytes of "
        "its compiled form (400 `grammar_too_large`)",
        default_text="256 KiB",
    )
    grammar_compile_timeout_s: float = setting(
        2.0,
        "input limits",
        "how long a new grammar may compile, in a worker thread after admission (400 `grammar_too_complex`; the "
        "verdict is cached by content hash)",
    )
    # admission
    max_concurrent_requests: int = setting(128, "admission", "responses running in the engine")
    max_queued_requests: int = setting(
        256, "admission", "responses waiting beyond those; past both, `server_overloaded` with `retry_after_ms`"
    )
    max_lanes_per_socket: int = setting(16, "admission", "distinct lanes (`stream_id`s) one socket may have open")
    max_responses_per_socket: int = setting(64, "admission", "responses in flight or queued in lanes, per socket")
    max_sockets_per_client: int = setting(64, "admission", "open websockets per client (its peer address)")
    max_responses_per_client: int = setting(
        64,
        "admission",
        "responses in flight per client, HTTP and websocket together (kept below concurrent + queued)",
    )
    max_streams_per_client: int = setting(
        64, "admission", "HTTP event streams (SSE, resume followers included) open at once per client (429)"
    )
    max_grammar_requests: int = setting(
        32, "admission", "sequences following a grammar in flight, server-wide (n choices count n; 429)"
    )
    max_grammar_requests_per_client: int = setting(8, "admission", "the same, per client")
    batch_priority: int = setting(10, "admission", 'the priority of `service_tier: "flex"` requests (lower runs first)')
    # responses
    default_max_output_tokens: int = setting(512, "responses", "when a request does not say (bounded by the context)")
    stream_pacing: bool = setting(
        False,
        "responses",
        "a step that brings several tokens (speculative decoding) streams one token per event, spread over the "
        "request's recent step interval; whole HTTP answers are not paced",
    )
    response_store_size: int = setting(1024, "responses", "finished responses kept for `previous_response_id`")
    response_store_ttl_s: float = setting(3600.0, "responses", "how long a stored response is kept")
    response_store_max_bytes: int = setting(
        256 << 20,
        "responses",
        "the stored conversations' encoded JSON, least recently used dropped first",
        default_text="256 MiB",
    )
    response_log_size: int = setting(
        256, "responses", "responses whose events are kept so a dropped stream can resume (`starting_after`)"
    )
    response_log_ttl_s: float = setting(600.0, "responses", "how long a finished response's events are kept")
    response_log_max_events: int = setting(16384, "responses", "events kept per response (past it, no resume: 410)")
    response_log_max_bytes: int = setting(
        128 << 20, "responses", "the response log's encoded events in all", default_text="128 MiB"
    )
    response_log_max_response_bytes: int = setting(
        8 << 20, "responses", "the response log's encoded events per response", default_text="8 MiB"
    )
    tool_call_parser: str = setting(
        "auto",
        "responses",
        "how `tool_choice: auto` replies are read: `hermes`, `llama3`, `mistral`; `auto` recognises the template's "
        "format (hermes when it knows no tools)",
    )
    reasoning_parser: str = setting(
        "auto",
        "responses",
        "how a reasoning model's thinking is read apart from its answer, as vLLM's flag: `qwen3` (a reply opening "
        "with `<think>`) or `deepseek_r1` (a reply starting inside it), given as `reasoning_content` (a `reasoning` "
        "item on the Responses API); `auto` recognises them from the chat template, `none` turns it off",
    )
    # observability
    log_level: str = setting(
        "info",
        "observability",
        "Cadenza's logging: at info what the engine chose at load and one `cadenza.requests` line per request (id, "
        "tokens in and out, TTFT, total, finish reason)",
        choices=UVICORN_LOG_LEVELS[:-1],
    )
    log_format: str = setting(
        "text",
        "observability",
        "`text`: one readable line per record; `json`: one JSON object per line (time, level, logger, message, and "
        "the request log's fields: id, tokens in and out, TTFT, total, finish reason)",
        choices=LOG_FORMATS,
    )
    uvicorn_log_level: str = setting(
        "warning",
        "observability",
        "uvicorn's own (its access log is at info), as vLLM's flag",
        choices=UVICORN_LOG_LEVELS,
    )
    metrics_push_interval_s: float = setting(
        5.0,
        "observability",
        "under Ray Serve: how often each replica posts its metrics, so /metrics on any replica answers for all "
        "(each sample labelled `replica`; a replica silent for 3 intervals is left out)",
    )
    kv_pull_min_tokens: int = setting(
        64,
        "responses",
        "under Ray Serve: a prompt whose cached prefix on another replica is at least this many tokens longer "
        "than on its own pulls that KV across (gateway/peer_kv.py) instead of recomputing it; 0 turns pulls off",
    )
    kv_pull_timeout_s: float = setting(
        5.0,
        "responses",
        "under Ray Serve: a KV pull from another replica slower than this is dropped and the prefix recomputed",
    )
    response_owner_timeout_s: float = setting(
        5.0,
        "responses",
        "under Ray Serve: a replica that has not written to the shared response log for this long is taken for "
        "dead, and its unfinished responses are re-issued on a survivor (gateway/shared_log.py)",
    )
    response_log_flush_s: float = setting(
        0.5,
        "responses",
        "under Ray Serve: the longest a replica goes without writing to the shared response log (its lease, and "
        "when it hears of cancels sent to other replicas); below response_owner_timeout_s",
    )
    metrics_prefix: str = setting(
        "cadenza",
        "observability",
        "the prefix of every metric at `/metrics`; `vllm` gives vLLM's exact names (its Grafana dashboard matches)",
    )

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
        timeouts = ("send_timeout_s", "idle_timeout_s", "header_timeout_s", "drain_timeout_s", "response_log_ttl_s")
        shared_log = ("response_owner_timeout_s", "response_log_flush_s")
        for name in (*timeouts, "metrics_push_interval_s", "kv_pull_timeout_s", *shared_log):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.response_log_flush_s >= self.response_owner_timeout_s:
            raise ValueError("response_log_flush_s must be below response_owner_timeout_s (a live replica's lease)")
        if self.tool_call_parser not in ("auto", *PARSERS):
            choices = ", ".join(PARSERS)
            raise ValueError(f"tool_call_parser must be auto or one of {choices}, got {self.tool_call_parser!r}")
        if self.kv_pull_min_tokens < 0:
            raise ValueError(f"kv_pull_min_tokens must be >= 0, got {self.kv_pull_min_tokens}")
        if self.sse_keep_alive_s < 0:
            raise ValueError(f"sse_keep_alive_s must be >= 0, got {self.sse_keep_alive_s}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            message = f"metrics_prefix must be a Prometheus name (letters, digits, _), got {self.metrics_prefix!r}"
            raise ValueError(message)
        if self.log_level not in UVICORN_LOG_LEVELS[:-1]:
            raise ValueError(f"log_level must be one of {', '.join(UVICORN_LOG_LEVELS[:-1])}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            levels = ", ".join(UVICORN_LOG_LEVELS)
            raise ValueError(f"uvicorn_log_level must be one of {levels}, got {self.uvicorn_log_level!r}")
        if self.reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
            choices = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {choices}, auto or none, got {self.reasoning_parser!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (omit it to serve without a key)")
        for name in ("tenant_api_keys", "priority_api_keys"):
            keys = getattr(self, name)
            if isinstance(keys, str) or not all(k.strip() for k in keys):
                raise ValueError(f"{name} must be a list of non-empty keys")
            object.__setattr__(self, name, tuple(keys))  # a YAML list
        if not MIN_PRIORITY <= self.batch_priority <= MAX_PRIORITY:
            raise ValueError(f"batch_priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.batch_priority}")
        grammar_caps = (self.max_grammar_bytes, self.max_grammar_requests, self.max_grammar_requests_per_client)
        if min(grammar_caps) < 1 or self.grammar_compile_timeout_s <= 0:
            message = "max_grammar_bytes, max_grammar_requests(_per_client) must be >= 1, grammar_compile_timeout_s > 0"
            raise ValueError(message)

    @property
    def response_log_bounds(self) -> tuple[int, float, int, int, int]:
        """ResponseLogs' bounds, in its argument order."""
        return (
            self.response_log_size, self.response_log_ttl_s, self.response_log_max_events,
            self.response_log_max_bytes, self.response_log_max_response_bytes,
        )  # fmt: skip

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

    @property
    def requires_key(self) -> bool:
        return self.api_key is not None or bool(self.tenant_api_keys)

    def key_accepts(self, candidates: list[str]) -> bool:
        """No key required, or one candidate equals api_key, a tenant key or a priority key
        (constant time)."""
        if not self.requires_key:
            return True
        keys = (self.api_key,) if self.api_key is not None else ()
        return _any_equal(candidates, (*keys, *self.tenant_api_keys, *self.priority_api_keys))

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
