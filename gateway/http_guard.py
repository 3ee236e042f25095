"""What every HTTP request passes before a route sees it, and the reading of JSON bodies.

`HttpGuard` is pure ASGI (BaseHTTPMiddleware would buffer and re-wrap streamed responses)
and refuses, in this order:
- while the server drains (503): clients retry elsewhere rather than start work that
  would be cut off;
- a foreign `Host` (421): a DNS-rebinding page reaches us under its own name, so only our
  names (settings.allowed_hosts, else the loopback names and the bound address) are served;
- a foreign `Origin` (403): a cross-site page's request carries its origin; the allow-list
  is the websocket's (settings.allowed_origins, else our own origin);
- a missing or wrong API key (401) on everything but PUBLIC_PATHS.
Websocket handshakes make the same checks in `app.handle_socket`, answered with an `error`
event, since a bare HTTP refusal of a handshake carries no message a client can show.
"""

from __future__ import annotations

import msgspec
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cadenza.gateway.chat_page import VENDOR_PREFIX
from cadenza.gateway.drain import Drain
from cadenza.gateway.json_scan import check_json
from cadenza.gateway.protocol import error_object
from cadenza.gateway.settings import GatewaySettings
from cadenza.request_limits import presented_keys

# The chat page holds no data (with a key set it is served without even the model name): a
# browser's first load cannot send a header, so the page takes the key from its address and
# sends it on the websocket itself. /health is for load balancers and orchestrators.
PUBLIC_PATHS = frozenset({"/", "/health", "/ping", "/version", "/openapi.json", "/docs"})
# The chat page's vendored libraries are public as the page is.
PUBLIC_PREFIX = VENDOR_PREFIX


class BodyError(Exception):
    """A request body refused before decoding, with its HTTP status and error code."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_body") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, code: str, param: str | None = None, **headers: str) -> JSONResponse:
    body = {"error": error_object(message, code, status, param)}
    return JSONResponse(body, status_code=status, headers=headers or None)


def host_refusal(host: str) -> str:
    name = host if host.endswith("]") else host.rsplit(":", 1)[0]  # the port off ("[::1]" has colons)
    return f"host {host!r} is not served here; start the server with --allowed-hosts {name} to serve it"


class HttpGuard:
    """check_host: off under Ray Serve unless allowed_hosts is set (see serve_app)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings, drain: Drain, check_host: bool = True) -> None:
        self.app, self.settings, self.drain, self.check_host = app, settings, drain, check_host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The path under the mount point (Ray Serve's route_prefix is the root_path), as routed.
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        await (self.refusal(Headers(scope=scope), path) or self.app)(scope, receive, send)

    def refusal(self, headers: Headers, path: str) -> JSONResponse | None:
        settings = self.settings
        if self.drain.draining:
            message = "the server is shutting down; retry on another replica or once it is back"
            return error_response(503, message, "server_shutting_down", Connection="close")
        host = headers.get("host")
        if self.check_host and not settings.host_allowed(host):
            return error_response(421, host_refusal(host), "host_not_allowed")
        origin = headers.get("origin")
        if not settings.origin_allowed(origin):
            message = f"origin {origin!r} is not allowed; start the server with --allowed-origins {origin} to allow it"
            return error_response(403, message, "origin_not_allowed")
        if not is_public(path) and not settings.key_accepts(presented_keys(headers, subprotocols=False)):
            return error_response(401, "missing or wrong API key", "invalid_api_key")
        return None


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX)


async def read_json(request: Request, kind: type, settings: GatewaySettings) -> object:
    """The body decoded as `kind`, or BodyError: 415 unless Content-Type is JSON (a web page
    can POST text/plain cross-site without a preflight), 413 past max_request_bytes, 400 for
    nesting past max_json_depth, integers past 64 bits and anything msgspec refuses."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        message = f"Content-Type must be application/json, got {media or 'none'!r}"
        raise BodyError(message, 415, "unsupported_media_type")
    raw = await read_body(request, settings.max_request_bytes)
    try:
        check_json(raw, settings.max_json_depth)
        return msgspec.json.decode(raw, type=kind)
    except (ValueError, RecursionError) as e:  # DecodeError is a ValueError; RecursionError a belt
        raise BodyError(f"invalid request body: {e}") from None


async def read_body(request: Request, limit: int) -> bytes:
    """Counted while it arrives (a chunked body has no Content-Length to trust), so no more
    than limit + one chunk is ever held."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> BodyError:
    return BodyError(f"the request body exceeds {limit} bytes (max_request_bytes)", 413, "request_too_large")
