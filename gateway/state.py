"""What every connection shares: the engine client, settings, admission, the response store,
and the turning of a `response.create` into prompt token ids and sampling parameters."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from cadenza.engine_client import EngineClient, TokensPrompt
from cadenza.gateway import tool_choice
from cadenza.gateway.admission import Admission
from cadenza.gateway.drain import Drain
from cadenza.gateway.grammar_budget import GrammarBudget
from cadenza.gateway.metrics import Metrics
from cadenza.gateway.openai_schema import ChatCompletionRequest, resolve_sampling
from cadenza.gateway.protocol import Json, ResponseCreate, input_messages
from cadenza.gateway.reasoning import parser_for as reasoning_parser_for
from cadenza.gateway.request_error import RequestError
from cadenza.gateway.response_events import ResponseLogs
from cadenza.gateway.response_format import combined, from_text_format
from cadenza.gateway.response_store import ConversationStore, LocalStore, Message
from cadenza.gateway.scheduling import request_priority
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.tool_calls import parser_for
from cadenza.gateway.tracing import Tracing
from cadenza.outputs import RequestOutput
from cadenza.request_limits import (
    TERMS,
    ContextLengthError,
    UnknownModelError,
    check_model,
    check_request,
    max_tokens_or_default,
    presented_key,
)
from cadenza.sampling_params import SamplingParams
from cadenza.structured_outputs import StructuredOutputs


@dataclass(slots=True)
class PreparedResponse:
    response_id: str
    messages: list[Message]  # the conversation so far, this response's input included
    prompt_ids: list[int]
    params: SamplingParams
    tools: tool_choice.ToolPlan | None = None  # function calls read from the reply
    session_id: str | None = None  # the conversation (its prefix KV is pinned between turns)
    priority: int = 0
    tenant: str | None = None  # tenant_salt: its prefix-cache salt, and whose response it is
    parent: str | None = None  # the response it continues (previous_response_id)
    history_len: int = 0  # messages[:history_len] are the stored conversation, the rest its input
    echo: dict[str, Any] | None = None  # the request's fields the response object shows, validated


class GatewayState:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        settings: GatewaySettings,
        tracing: Tracing,
        store: ConversationStore | None = None,
        logs: ResponseLogs | None = None,
    ) -> None:
        """store, logs: the conversations and the response events (this process's by default;
        under Serve, shared by every replica)."""
        self.engine = engine
        self.model_name = model_name
        self.settings = settings
        self.admission = Admission(settings)
        self.grammars = GrammarBudget(settings)  # after admission: compile budget and quota
        self.drain = Drain(self.admission)  # shutdown: refuse new work, end what outlives the drain
        s = settings
        self.store = store or LocalStore(s.response_store_size, s.response_store_ttl_s, s.response_store_max_bytes)
        self.logs = logs if logs is not None else ResponseLogs(*s.response_log_bounds)  # an empty one is falsy
        self.tokenizer = engine.get_tokenizer()
        # The model's generation_config sampling defaults (an engine double may have none).
        self.sampling_defaults: dict[str, float] = dict(getattr(engine, "sampling_defaults", None) or {})
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_parser = parser_for(template, settings.tool_call_parser)
        self.reasoning_parser = reasoning_parser_for(template, settings.reasoning_parser)  # "": none
        self.metrics = Metrics(model_name, settings.metrics_prefix)
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
        priority: int = 0,
        session_id: str | None = None,
        resume_from: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's deltas, paced when stream_pacing is set and the client reads a stream;
        resume_from: outputs already produced (a re-issued response goes on after them)."""
        pace = stream and self.settings.stream_pacing
        more = {"resume_from": resume_from} if resume_from else {}  # engine doubles need not know it
        deltas = self.engine.generate(
            TokensPrompt(prompt_ids), params, request_id=request_id, pace=pace,
            cache_salt=cache_salt, priority=priority, session_id=session_id, **more,
        )  # fmt: skip
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

    async def prepare(
        self, create: ResponseCreate, response_id: str | None = None, headers: Any = None
    ) -> PreparedResponse:
        """Runs after admission. The chat template and the tokenizer run in a worker thread: a
        long conversation takes them many milliseconds, which on the loop would stall every
        socket. The store and the checks stay on the loop (the store is not thread-safe)."""
        self.check_model(create.model)
        self.check_session_key(create.prompt_cache_key)
        tenant = tenant_salt(presented_key(headers) if headers is not None else None, create.cache_salt)
        priority = request_priority(create.priority, create.service_tier, headers, self.settings)
        return await self.prepare_as(create, tenant, priority, response_id)

    async def prepare_as(
        self, create: ResponseCreate, tenant: str | None, priority: int, response_id: str | None = None
    ) -> PreparedResponse:
        """prepare for a known tenant and priority (a re-issue on another replica has no headers)."""
        try:
            new = input_messages(create.input)
        except ValueError as e:
            raise RequestError(str(e), "invalid_input", "input") from None
        if not new or not any(m["content"] for m in new):
            raise RequestError("input is required and must not be empty", "missing_input", "input")
        history, session = await self._history(create.previous_response_id, tenant)
        messages = history + new
        response_id = response_id or new_id("resp")
        system = [{"role": "system", "content": create.instructions}] if create.instructions else []
        chat = as_chat_request(create, system + messages)
        tools, shown = tool_choice.plan(chat, self.tool_parser)
        prompt_ids = await asyncio.to_thread(self._render, chat, shown)
        text_format = from_text_format(create.text)
        grammar = combined(text_format, tool_choice.grammar(tools, chat))
        params = self._params(create, len(prompt_ids), grammar)
        self.check(params, prompt_ids, "input")
        session = create.prompt_cache_key or session or response_id  # the engine keys it by tenant
        echo = _echo(create.text if text_format else None, chat, tools)
        return PreparedResponse(
            response_id, messages, prompt_ids, params, tools, session, priority, tenant,
            create.previous_response_id, len(history), echo,
        )  # fmt: skip

    def _render(self, chat: ChatCompletionRequest, shown: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids of the conversation (thread-safe: the compiled template and the
        tokenizer hold no per-call state)."""
        turns, variables = tool_choice.messages(chat, shown, self.tokenizer.chat_template)
        # Special-token text in a message's content stays text (no spoofed turns).
        return self.tokenizer.encode_chat(self.tokenizer.render_chat(turns, True, variables))

    async def _history(self, previous_response_id: str | None, tenant: str | None) -> tuple[list[Message], str | None]:
        """The stored conversation and the session it belongs to. Another tenant's response is
        not found, with the same message as an id never issued."""
        if previous_response_id is None:
            return [], None
        stored = await self.store.get(previous_response_id, tenant)
        if stored is None:
            raise RequestError(
                f"previous response {previous_response_id!r} not found (responses are kept for "
                f"{self.settings.response_store_ttl_s:.0f} s, at most {self.settings.response_store_size})",
                "previous_response_not_found",
                "previous_response_id",
            )
        return stored.messages, stored.session_id

    def check_session_key(self, key: str | None) -> None:
        """prompt_cache_key names the session the engine pins: bounded, as every client string is."""
        limit = self.settings.max_prompt_cache_key_chars
        if key is not None and len(key) > limit:
            message = f"prompt_cache_key is longer than {limit} characters (max_prompt_cache_key_chars)"
            raise RequestError(message, "invalid_request", "prompt_cache_key")

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

    def _params(self, create: ResponseCreate, prompt_len: int, grammar: StructuredOutputs | None) -> SamplingParams:
        default = self.settings.default_max_output_tokens
        names = ("input", "max_output_tokens")
        max_tokens = self.max_tokens(prompt_len, create.max_output_tokens, default, names, names)
        try:
            chosen = resolve_sampling(create, self.sampling_defaults)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=chosen["temperature"],
                top_p=chosen["top_p"],
                top_k=chosen["top_k"],
                min_p=chosen["min_p"],
                repetition_penalty=chosen["repetition_penalty"],
                logprobs=create.top_logprobs,
                structured_outputs=grammar,
            )
        except ValueError as e:
            raise RequestError(str(e), "invalid_request") from None
        return params


def as_chat_request(create: ResponseCreate, messages: list[Message]) -> ChatCompletionRequest:
    """A Responses request as the chat-completions request it amounts to, so both APIs share
    one tool and template path (Responses tools are flat: {type, name, parameters})."""
    if any(t.get("type") != "function" for t in create.tools or []):
        raise RequestError("only tools of type function are supported", "invalid_request", "tools")
    tools = [{"type": "function", "function": _without(t, "type")} for t in create.tools or []]
    body = {"messages": messages, "tools": tools or None, "tool_choice": create.tool_choice}
    try:
        return msgspec.convert({**body, "parallel_tool_calls": create.parallel_tool_calls}, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise RequestError(f"invalid tools or input: {e}", "invalid_request", "tools") from None


def _echo(text: dict[str, Any] | None, chat: ChatCompletionRequest, tools: tool_choice.ToolPlan | None) -> Json:
    """The request's fields a response object shows, as validated: the function definitions,
    the tool choice and the text format (`text`: a grammar's, else None) without any other keys
    a client sent, so every response event echoes only what the request used."""
    fmt = {k: v for k, v in text["format"].items() if k in _FORMAT_KEYS} if text else {"type": "text"}
    choice: str | Json = "none" if tools is None else tools.mode
    if tools is not None and tools.mode == "named":
        choice = {"type": "function", "name": tools.name}
    functions = [{"type": "function", **_fields(t.function)} for t in chat.all_tools]
    return {"tools": functions, "text": {"format": fmt}, "tool_choice": choice}


_FORMAT_KEYS = ("type", "name", "description", "schema", "strict")


def _fields(struct: msgspec.Struct) -> dict[str, Any]:
    return {k: v for k, v in msgspec.structs.asdict(struct).items() if v is not None}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


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
