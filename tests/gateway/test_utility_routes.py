"""The routes clients and tooling call beside the completions, as vLLM serves them: the SDK's
models.retrieve, /tokenize and /detokenize, /version, /ping; SSE headers a proxy respects and
a keep-alive comment during a long wait for the first token; CORS for the origins named."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

ALLOWED = "https://app.example"


class Reply:
    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status_code, self.headers, self.text = status, headers, body.decode()

    def json(self) -> Any:
        return json.loads(self.text)


def _call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> Reply:
    data = None if body is None else json.dumps(body).encode()
    all_headers = {**({"Content-Type": "application/json"} if data else {}), **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return Reply(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.headers, e.read())


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # A first token 1.2 s away, keep-alive comments every 0.3 s.
    settings = GatewaySettings(port=free_port(), allowed_origins=(ALLOWED,), sse_keep_alive_s=0.3)
    with serve_in_thread(build_app(PacedEngine(1.2), DEFAULT_MODEL, settings), settings.port):
        yield f"http://127.0.0.1:{settings.port}"


def test_the_sdk_retrieves_the_model_and_an_unknown_one_is_404(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    model = client.models.retrieve(DEFAULT_MODEL)
    assert model.id == DEFAULT_MODEL and model.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tokenize_and_detokenize_round_trip(base: str) -> None:
    ids = _call("POST", base + "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 2048
    text = _call("POST", base + "/detokenize", {"tokens": ids["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = _call("POST", base + "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > ids["count"]  # the template's own tokens around the message
    bad = _call("POST", base + "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    both = _call("POST", base + "/tokenize", {"prompt": "a", "messages": []})
    assert both.status_code == 400 and "exactly one of prompt and messages" in both.text


def test_version_and_ping(base: str) -> None:
    assert _call("GET", base + "/version").json()["version"]
    assert _call("GET", base + "/ping").status_code == 200 and _call("POST", base + "/ping", {}).status_code == 200


def test_sse_headers_and_keep_alive_before_the_first_token(base: str) -> None:
    body = {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 1, "stream": True}
    reply = _call("POST", base + "/v1/completions", body)
    assert reply.headers["cache-control"] == "no-cache" and reply.headers["x-accel-buffering"] == "no"
    raw = reply.text
    first_event = raw.index("data: ")
    assert ": keep-alive" in raw[:first_event]  # comments while the first token was 1.2 s away
    assert raw.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("origin,allowed", [(ALLOWED, True), ("https://evil.example", False)])
def test_cors_preflight(base: str, origin: str, allowed: bool) -> None:
    asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    reply = _call("OPTIONS", base + "/v1/chat/completions", headers={"Origin": origin, **asks})
    assert (reply.status_code == 200) == allowed
    assert (reply.headers.get("access-control-allow-origin") == origin) == allowed
    models = _call("GET", base + "/v1/models", headers={"Origin": origin})
    assert (models.status_code == 200) == allowed  # the guard refuses the other origin's request too
    assert (models.headers.get("access-control-allow-origin") == origin) == allowed


def test_the_openapi_document_and_its_page(base: str) -> None:
    """vLLM's /openapi.json and /docs: every route, and the bodies' schemas from the Structs the
    routes decode (so a field the server takes is in the document)."""
    doc = _call("GET", base + "/openapi.json").json()
    assert doc["openapi"].startswith("3.") and doc["info"]["version"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/v1/models/{model_id}"):
        assert path in doc["paths"], path
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = doc["components"]["schemas"][chat["$ref"].rsplit("/", 1)[1]]["properties"]
    assert {"messages", "tools", "response_format", "stream_options", "max_completion_tokens"} <= set(fields)
    page = _call("GET", base + "/docs")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "<script" not in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
