"""The small routes clients and tooling call beside the completions (as vLLM serves them):
GET /v1/models/{id} (the SDK's models.retrieve), POST /tokenize and /detokenize, GET /version,
GET /ping (a load balancer's liveness probe: /health's answer)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cadenza.gateway.http_guard import BodyError, error_response, read_json
from cadenza.gateway.state import GatewayState
from cadenza.version import package_version


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A prompt, or chat messages rendered by the model's template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class UtilityRoutes:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def card(self) -> dict[str, Any]:
        state = self.state
        return {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "cadenza",
            "max_model_len": state.engine.max_model_len,
        }

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.state.model_name:
            return error_response(404, f"the model {model_id!r} does not exist", "model_not_found", "model")
        return JSONResponse(self.card())

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request, TokenizeRequest, self.state.settings)
            if (body.prompt is None) == (body.messages is None):
                raise BodyError("give exactly one of prompt and messages")
            tokens = await asyncio.to_thread(self._tokenize, body)  # tokenizers are CPU work
        except BodyError as e:
            return error_response(e.status, str(e), e.code)
        except ValueError as e:  # a template that fails, messages it refuses
            return error_response(400, str(e), "invalid_request_error")
        return JSONResponse({"count": len(tokens), "max_model_len": self.state.engine.max_model_len, "tokens": tokens})

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        tokenizer = self.state.tokenizer
        if body.messages is not None:
            chat = tokenizer.render_chat(body.messages, body.add_generation_prompt)
            return tokenizer.encode_chat(chat)
        return tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request, DetokenizeRequest, self.state.settings)
        except BodyError as e:
            return error_response(e.status, str(e), e.code)
        vocab = self.state.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            return error_response(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "invalid_token")
        text = await asyncio.to_thread(self.state.tokenizer.decode, body.tokens, False)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": package_version()})
