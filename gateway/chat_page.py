"""The chat page at `/` and the browser libraries it loads from `/static/vendor/` (markdown,
its sanitiser, code highlighting: gateway/static/vendor/LICENSES.md), under a
Content-Security-Policy that lets the page run its own code and nothing injected."""

from __future__ import annotations

import base64
import hashlib
import html
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response

# The files /static/vendor/ serves: named here, so no path a client sends reaches the disk.
VENDORED = ("marked.js", "purify.min.js", "highlight.min.js")
VENDOR_PREFIX = "/static/vendor/"
# The vendored files change only with the package: a day in the browser's cache.
_VENDOR_HEADERS = {"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"}


def page_policy(page: str) -> str:
    """The chat page's Content-Security-Policy: its own inline script and style (by hash, so an
    injected one never runs), script files from its own origin (the vendored libraries; every
    other same-origin answer is JSON or text, which nosniff keeps from running), connections to
    its own origin (HTTP and websocket), nothing else; no framing, no forms posting elsewhere,
    no <base> rewriting."""
    hashes = {tag: inline_hash(page, tag) for tag in ("script", "style")}
    return (
        f"default-src 'none'; script-src 'self' {hashes['script']}; style-src {hashes['style']}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def inline_hash(page: str, tag: str) -> str:
    body = page.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


class ChatPage:
    """`/` and `/static/vendor/{name}`, both public (http_guard.is_public)."""

    def __init__(self, model_name: str, hide_model: bool) -> None:
        page = files("cadenza.gateway").joinpath("static/chat.html").read_text()
        # With a key set the public page names no model; it learns the name from /v1/models.
        self.page = page.replace("{{MODEL}}", "" if hide_model else html.escape(model_name))
        self.headers = {
            "Referrer-Policy": "no-referrer",  # no Referer can carry a key from its address
            "X-Frame-Options": "DENY",
            "Content-Security-Policy": page_policy(self.page),
            "X-Content-Type-Options": "nosniff",
        }
        vendor = files("cadenza.gateway").joinpath("static/vendor")
        self.vendored = {name: vendor.joinpath(name).read_bytes() for name in VENDORED}

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page, headers=self.headers)

    async def vendor(self, request: Request) -> Response:
        body = self.vendored.get(request.path_params["name"])
        if body is None:
            return PlainTextResponse("not found", status_code=404)
        return Response(body, media_type="text/javascript", headers=_VENDOR_HEADERS)
