"""The ASGI app: the chat page, /health, /stats, the /v1/responses websocket and the
OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models).

The same app is what `cadenza serve` runs on uvicorn and what Ray Serve will mount.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from cadenza.engine_client import EngineClient
from cadenza.errors import EngineDeadError
from cadenza.gateway.chat_page import VENDOR_PREFIX, ChatPage
from cadenza.gateway.http_guard import HttpGuard, host_refusal
from cadenza.gateway.openai_http import OpenAIHttp
from cadenza.gateway.openapi import OpenApiRoutes
from cadenza.gateway.protocol import encode, error_event
from cadenza.gateway.response_events import ResponseLogs
from cadenza.gateway.response_store import ConversationStore
from cadenza.gateway.responses_http import ResponsesHttp
from cadenza.gateway.responses_ws import ResponsesSocket
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.state import GatewayState
from cadenza.gateway.tracing import Tracing, provider_from_env
from cadenza.gateway.utility_routes import UtilityRoutes
from cadenza.request_limits import key_subprotocol, offered_subprotocols, presented_keys

if TYPE_CHECKING:  # Ray, imported only under Serve
    from cadenza.gateway.replica_metrics import MetricsBoard


def build_app(
    engine: EngineClient,
    model_name: str,
    settings: GatewaySettings,
    tracer_provider: TracerProvider | None = None,
    check_host: bool = True,
    store: ConversationStore | None = None,
    metrics_board: MetricsBoard | None = None,
    logs: ResponseLogs | None = None,
) -> Starlette:
    """tracer_provider: where request spans go (default: as the OTEL_* variables say, else off).
    check_host: refuse a Host header that is not ours (off under Ray Serve unless allowed_hosts
    is set: its proxy is reached by whatever name the cluster gives it). store: where
    conversations are kept (default: in this process; Serve replicas share one). metrics_board:
    under Serve, where /metrics gathers every replica's (gateway/replica_metrics.py). logs: the
    response events (default: in this process; Serve replicas mirror theirs to one shared log)."""
    tracing = Tracing(tracer_provider or provider_from_env())
    state = GatewayState(engine, model_name, settings, tracing, store, logs)
    page = ChatPage(model_name, hide_model=settings.requires_key)

    async def health(request: Request) -> Response:
        try:
            await engine.check_health()
        except Exception as e:  # any failure to answer is "not serving"
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        try:
            engine_stats = msgspec.to_builtins(await engine.stats())
        except EngineDeadError as e:  # dead, or being restarted: the client may retry
            return JSONResponse({"error": {"message": str(e), "type": "engine_unavailable"}}, status_code=503)
        # The pid answering (a Serve replica's own): with the engine's and the workers' pids,
        # what `cadenza bench serve` reads the serving tree's memory of.
        gateway = {
            "in_flight": state.admission.in_flight,
            "stored_responses": await state.store.size(),
            "logged_responses": len(state.logs),
            "gateway_pid": os.getpid(),
        }
        return JSONResponse({"engine": engine_stats, "gateway": gateway})

    async def metrics(request: Request) -> Response:
        body = await state.metrics.render(engine)
        if metrics_board is not None:  # a Serve replica: every replica's, each labelled
            body = await metrics_board.scrape(body)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if metrics_board is not None:
        metrics_board.bind(lambda: state.metrics.render(engine))

    async def responses(ws: WebSocket) -> None:
        await handle_socket(ws, state, check_host)

    http = OpenAIHttp(state)
    responses_http = ResponsesHttp(state)
    if logs is not None and logs.shared:  # a dead replica's responses, re-issued here
        logs.on_adopt = responses_http.adopt  # type: ignore[attr-defined]  # MirroredLogs
    utility = UtilityRoutes(state)
    api_doc = OpenApiRoutes()
    routes = [
        Route("/", page.index),
        Route(VENDOR_PREFIX + "{name}", page.vendor),
        Route("/v1/models", http.models),
        Route("/v1/models/{model_id:path}", utility.model),
        Route("/tokenize", utility.tokenize, methods=["POST"]),
        Route("/detokenize", utility.detokenize, methods=["POST"]),
        Route("/version", utility.version),
        Route("/openapi.json", api_doc.openapi),
        Route("/docs", api_doc.docs),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/v1/chat/completions", http.chat_completions, methods=["POST"]),
        Route("/v1/completions", http.completions, methods=["POST"]),
        Route("/health", health),
        Route("/stats", stats),
        Route("/metrics", metrics),
        WebSocketRoute("/v1/responses", responses),
        Route("/v1/responses", responses_http.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_http.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses_http.cancel, methods=["POST"]),
    ]
    guard = Middleware(HttpGuard, settings=settings, drain=state.drain, check_host=check_host)
    app = Starlette(routes=routes, middleware=[*cors(settings), guard])
    app.state.gateway = state
    return app


def cors(settings: GatewaySettings) -> list[Middleware]:
    """CORS headers for the origins --allowed-origins names (vLLM's flag): a browser app there
    may read our answers. Outermost, so it answers preflights itself (they carry no key); a
    preflight from any other origin is refused, and its request then by the guard's Origin
    check. No origins named: none is sent (the chat page is same-origin)."""
    if not settings.allowed_origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            allow_credentials=False,  # the API key travels in a header, never in cookies
            expose_headers=["Retry-After", "X-Request-Id"],
        )
    ]


async def handle_socket(ws: WebSocket, state: GatewayState, check_host: bool = True) -> None:
    problem = _handshake_problem(ws, state, check_host)
    client = state.admission.client(ws.client.host if ws.client else None)
    if problem is None and not state.admission.open_socket(client):
        problem = error_event(f"too many sockets from {client} (max_sockets_per_client)", "too_many_sockets", 429)
        client = None
    await ws.accept(subprotocol=key_subprotocol(offered_subprotocols(ws.headers)))
    if problem is not None:  # accept, say why, close: a bare refusal would carry no message
        await ws.send_text(encode({**problem, "sequence_number": 0}).decode())
        await ws.close(code=1008)
        return
    try:
        await ResponsesSocket(ws, state).serve()
    finally:
        state.admission.close_socket(client)


def _handshake_problem(ws: WebSocket, state: GatewayState, check_host: bool) -> dict | None:
    settings = state.settings
    if state.drain.draining:
        return error_event("the server is shutting down; connect again shortly", "server_shutting_down", 503)
    host = ws.headers.get("host")
    if check_host and not settings.host_allowed(host):
        return error_event(host_refusal(host), "host_not_allowed", 421)
    origin = ws.headers.get("origin")
    if not settings.origin_allowed(origin):
        return error_event(f"origin {origin!r} is not allowed", "origin_not_allowed", 403)
    if not settings.key_accepts(presented_keys(ws.headers)):  # the bearer key or any key subprotocol
        return error_event("missing or wrong API key", "invalid_api_key", 401)
    return None
