"""The ASGI app: the chat page, /health, /stats, the /v1/responses websocket and the
OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models).

The same app is what `cadenza serve` runs on uvicorn and what Ray Serve will mount.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import msgspec
from cadenza.gateway.openai_http import OpenAIHttp
from cadenza.gateway.protocol import encode, error_event
from cadenza.gateway.responses_ws import ResponsesSocket
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.state import GatewayState
from cadenza.gateway.tracing import Tracing, provider_from_env
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

# Browsers cannot set headers on a websocket; they may offer the key as this subprotocol.
KEY_SUBPROTOCOL = "openai-insecure-api-key."


def build_app(
    engine: Any, model_name: str, settings: GatewaySettings, tracer_provider: TracerProvider | None = None
) -> Starlette:
    """tracer_provider: where request spans go (default: as the OTEL_* variables say, else off)."""
    state = GatewayState(engine, model_name, settings, Tracing(tracer_provider or provider_from_env()))
    page = files("cadenza.gateway").joinpath("static/chat.html").read_text()

    async def index(request: Request) -> Response:
        return HTMLResponse(page.replace("{{MODEL}}", model_name))

    async def health(request: Request) -> Response:
        try:
            await engine.check_health()
        except Exception as e:  # any failure to answer is "not serving"
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        engine_stats = msgspec.to_builtins(await engine.stats())
        gateway = {"in_flight": state.admission.in_flight, "stored_responses": len(state.store)}
        return JSONResponse({"engine": engine_stats, "gateway": gateway})

    async def metrics(request: Request) -> Response:
        return Response(await state.metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    async def responses(ws: WebSocket) -> None:
        await handle_socket(ws, state)

    http = OpenAIHttp(state)
    routes = [
        Route("/", index),
        Route("/v1/models", http.models),
        Route("/v1/chat/completions", http.chat_completions, methods=["POST"]),
        Route("/v1/completions", http.completions, methods=["POST"]),
        Route("/health", health),
        Route("/stats", stats),
        Route("/metrics", metrics),
        WebSocketRoute("/v1/responses", responses),
    ]
    app = Starlette(routes=routes)
    app.state.gateway = state
    return app


async def handle_socket(ws: WebSocket, state: GatewayState) -> None:
    settings = state.settings
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    problem = _handshake_problem(ws, settings, offered)
    client = ws.client.host if ws.client else "unknown"
    if problem is None and not state.admission.open_socket(client):
        problem = error_event(f"too many sockets from {client} (max_sockets_per_client)", "too_many_sockets", 429)
        client = None
    key_protocol = next((p for p in offered if p.startswith(KEY_SUBPROTOCOL)), None)
    await ws.accept(subprotocol=key_protocol)
    if problem is not None:  # accept, say why, close: a bare refusal would carry no message
        await ws.send_text(encode({**problem, "sequence_number": 0}).decode())
        await ws.close(code=1008)
        return
    try:
        await ResponsesSocket(ws, state).serve()
    finally:
        state.admission.close_socket(client)


def _handshake_problem(ws: WebSocket, settings: GatewaySettings, offered: list[str]) -> dict | None:
    origin = ws.headers.get("origin")
    if not settings.origin_allowed(origin):
        return error_event(f"origin {origin!r} is not allowed", "origin_not_allowed", 403)
    auth = ws.headers.get("authorization", "")
    candidates = [auth.removeprefix("Bearer ").strip()] if auth.startswith("Bearer ") else []
    candidates += [p.removeprefix(KEY_SUBPROTOCOL) for p in offered if p.startswith(KEY_SUBPROTOCOL)]
    if not settings.key_accepts(candidates):
        return error_event("missing or wrong API key", "invalid_api_key", 401)
    return None
