"""The OpenAPI document (`/openapi.json`) and a page that reads it (`/docs`), as vLLM's server
offers: every route, and the request bodies' schemas made by msgspec from the very Structs
the routes decode, so the document cannot drift from what the server accepts. The page is
plain HTML rendered here (no script, no Swagger bundle), public as the document is: neither
names a model or holds data."""

from __future__ import annotations

import html
import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from cadenza.gateway.chat_page import inline_hash
from cadenza.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from cadenza.gateway.protocol import ResponseCreate
from cadenza.gateway.utility_routes import DetokenizeRequest, TokenizeRequest
from cadenza.version import package_version

# (method, path, summary, request body Struct or None)
ROUTES: tuple[tuple[str, str, str, type | None], ...] = (
    ("post", "/v1/chat/completions", "Chat completions (OpenAI); SSE with stream: true", ChatCompletionRequest),
    ("post", "/v1/completions", "Completions (OpenAI): text or token ids, one or a batch", CompletionRequest),
    ("post", "/v1/responses", "A response (OpenAI Responses API); stream, background", ResponseCreate),
    ("get", "/v1/responses/{response_id}", "A stored response; ?stream=true&starting_after=N resumes its events", None),
    ("post", "/v1/responses/{response_id}/cancel", "Cancel a background response", None),
    ("get", "/v1/models", "The served model", None),
    ("get", "/v1/models/{model_id}", "One model by id", None),
    ("post", "/tokenize", "Token ids of a prompt or a chat (vLLM)", TokenizeRequest),
    ("post", "/detokenize", "Text of token ids (vLLM)", DetokenizeRequest),
    ("get", "/health", "200 when the engine can serve, else 503 with the reason", None),
    ("get", "/ping", "The same as /health (SageMaker's name)", None),
    ("get", "/version", "The server's version", None),
    ("get", "/metrics", "Prometheus metrics (vLLM's names with --metrics-prefix vllm)", None),
    ("get", "/stats", "Engine and gateway counters (JSON)", None),
)  # fmt: skip
PUBLIC = {"/health", "/ping", "/version"}


def openapi_document() -> dict[str, Any]:
    bodies = [body for *_, body in ROUTES if body is not None]
    refs, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    schema_of = dict(zip(bodies, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, body in ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        params = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if params:
            op["parameters"] = [
                {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params
            ]
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema_of[body]}}}
        if path in PUBLIC:
            op["security"] = []
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Cadenza", "version": package_version()},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _page(document: dict[str, Any]) -> str:
    rows = []
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            detail = ""
            if body is not None:
                name = body["$ref"].rsplit("/", 1)[1]
                schema = json.dumps(document["components"]["schemas"][name], indent=2)
                detail = f"<details><summary>{name}</summary><pre>{html.escape(schema)}</pre></details>"
            rows.append(
                f"<tr><td><b>{method.upper()}</b></td><td><code>{html.escape(path)}</code></td>"
                f"<td>{html.escape(op['summary'])}{detail}</td></tr>"
            )
    version = html.escape(document["info"]["version"])
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Cadenza API</title>'
        "<style>body{font:14px/1.5 system-ui,sans-serif;margin:24px;max-width:1000px}"
        "td{vertical-align:top;padding:4px 10px;border-bottom:1px solid #eee}"
        "pre{font-size:12px;background:#f6f6f4;padding:8px;overflow-x:auto}</style></head><body>"
        f"<h1>Cadenza API <small>{version}</small></h1>"
        '<p>The OpenAPI document: <a href="openapi.json">openapi.json</a>. Send '
        "<code>Authorization: Bearer KEY</code> when the server has an API key.</p>"
        f"<table>{''.join(rows)}</table></body></html>"
    )


class OpenApiRoutes:
    """`/openapi.json` and `/docs`, built once."""

    def __init__(self) -> None:
        self.document = openapi_document()
        self.page = _page(self.document)
        policy = f"default-src 'none'; style-src {inline_hash(self.page, 'style')}; base-uri 'none'; form-action 'none'"
        self.headers = {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff"}

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self.document)

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(self.page, headers=self.headers)
