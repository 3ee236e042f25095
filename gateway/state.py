"""What every connection shares: the engine client, settings, admission, the response store,
and the turning of a `response.create` into prompt token ids and sampling parameters."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cadenza.engine_client import EngineClient
from cadenza.gateway.admission import Admission
from cadenza.gateway.drain import Drain
from cadenza.gateway.metrics import Metrics
from cadenza.gateway.protocol import ResponseCreate, input_messages
from cadenza.gateway.response_store import Message, ResponseStore
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.tracing import Tracing
from cadenza.outputs import RequestOutput
from cadenza.request_limits import (
    TERMS,
    ContextLengthError,
    UnknownModelError,
    check_model,
    check_request,
    max_tokens_or_default,
)
from cadenza.sampling_params import SamplingParams


class RequestError(ValueError):
    """A client mistake, reported as an `error` event (or HTTP 4xx) with code and param."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(slots=True)
class PreparedResponse:
    response_id: str
    messages: list[Message]  # the conversation so far, this response's input included
    prompt_ids: list[int]
    params: SamplingParams


class GatewayState:
    def __init__(self, engine: EngineClient, model_name: str, settings: GatewaySettings, tracing: Tracing) -> None:
        self.engine = engine
        self.model_name = model_name
        self.settings = settings
        self.admission = Admission(settings)
        self.drain = Drain(self.admission)  # shutdown: refuse new work, end what outlives the drain
        self.store = ResponseStore(settings.response_store_size, settings.response_store_ttl_s)
        self.tokenizer = engine.get_tokenizer()
        self.metrics = Metrics(model_name)
        self.tracing = tracing
        # Speculation on: streams and usage report how many drafts the model accepted.
        self.speculative = engine.speculative

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        stream: bool,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's deltas, paced when stream_pacing is set and the client reads a stream."""
        pace = stream and self.settings.stream_pacing
        deltas = self.engine.generate(
            {"prompt_token_ids": prompt_ids}, params, request_id=request_id, pace=pace, cache_salt=cache_salt
        )
        return self.drain.track(deltas)

    def check(self, params: SamplingParams, prompt_ids: list[int], param: str) -> None:
        """The engine's own request checks (cadenza.request_limits), run here so a bad value is a
        400 / `error` event before any work, with the message the engine would give."""
        try:
            check_request(params, prompt_ids, self.engine.request_limits)
        except ContextLengthError as e:  # the callers check the context first, in their own terms
            raise RequestError(str(e), "context_length_exceeded", param) from None
        except ValueError as e:
            raise RequestError(str(e), "invalid_request", param) from None

    async def prepare(self, create: ResponseCreate, response_id: str | None = None) -> PreparedResponse:
        """Runs after admission. The chat template and the tokenizer run in a worker thread: a
        long conversation takes them many milliseconds, which on the loop would stall every
        socket. The store and the checks stay on the loop (the store is not thread-safe)."""
        self.check_model(create.model)
        try:
            new = input_messages(create.input)
        except ValueError as e:
            raise RequestError(str(e), "invalid_input", "input") from None
        if not new or not any(m["content"] for m in new):
            raise RequestError("input is required and must not be empty", "missing_input", "input")
        messages = self._history(create.previous_response_id) + new
        system = [{"role": "system", "content": create.instructions}] if create.instructions else []
        prompt_ids = await asyncio.to_thread(self._render, system + messages)
        params = self._params(create, len(prompt_ids))
        self.check(params, prompt_ids, "input")
        return PreparedResponse(response_id or new_id("resp"), messages, prompt_ids, params)

    def _render(self, messages: list[Message]) -> list[int]:
        """Prompt token ids of the conversation (thread-safe: the compiled template and the
        tokenizer hold no per-call state)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _history(self, previous_response_id: str | None) -> list[Message]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise RequestError(
                f"previous response {previous_response_id!r} not found (responses are kept for "
                f"{self.settings.response_store_ttl_s:.0f} s, at most {self.settings.response_store_size})",
                "previous_response_not_found",
                "previous_response_id",
            )
        return list(stored.messages)

    def check_model(self, requested: str | None) -> None:
        try:
            check_model(requested, self.model_name)
        except UnknownModelError as e:
            raise RequestError(str(e), "model_not_found", "model") from None

    def max_tokens(
        self, prompt_len: int, asked: int | None, default: int, params: tuple[str, str], terms: tuple[str, str] = TERMS
    ) -> int:
        """max_tokens for a request: as asked once it fits the context, else `default` capped by
        the room left. params / terms: this API's names of (the prompt, max_tokens) as error
        param / in the message."""
        try:
            return max_tokens_or_default(prompt_len, asked, self.engine.max_model_len, default, terms)
        except ContextLengthError as e:
            param = params[0] if e.field == "prompt" else params[1]
            raise RequestError(str(e), "context_length_exceeded", param) from None

    def _params(self, create: ResponseCreate, prompt_len: int) -> SamplingParams:
        default = self.settings.default_max_output_tokens
        names = ("input", "max_output_tokens")
        max_tokens = self.max_tokens(prompt_len, create.max_output_tokens, default, names, names)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if create.temperature is None else create.temperature,
                top_p=1.0 if create.top_p is None else create.top_p,
                logprobs=create.top_logprobs,
            )
        except ValueError as e:
            raise RequestError(str(e), "invalid_request") from None
        return params


def tenant_salt(api_key: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its tenant (the API key it sent) and its own
    `cache_salt`, hashed. Requests of different tenants never share KV blocks, so the cached
    token count a client sees is made of its own tenant's prompts only (otherwise a client
    could probe another's prompt block by block). No key and no salt: one shared cache."""
    if not api_key and not cache_salt:
        return None
    return hashlib.sha256(f"{api_key or ''}\0{cache_salt or ''}".encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
