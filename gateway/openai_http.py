"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions (SSE or whole), /v1/models.

Same engine, API key, limits and error shape as the websocket. Over capacity is a 429
with Retry-After before any work starts; a client that disconnects mid-stream has its
request aborted (the SSE generator is closed, which closes the engine stream), and so has
one that stops reading, once a send waits past send_timeout_s (send_deadline.SseStream).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.gateway import tool_choice
from cadenza.gateway.admission import RETRY_AFTER
from cadenza.gateway.batch_run import BatchRun
from cadenza.gateway.chat_run import ChatRun
from cadenza.gateway.completion_run import CompletionRun
from cadenza.gateway.http_guard import BodyError, error_response, read_json
from cadenza.gateway.openai_run import Admitted, Body, OpenAIRun
from cadenza.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from cadenza.gateway.response_format import combined, requested_grammar
from cadenza.gateway.scheduling import request_priority
from cadenza.gateway.send_deadline import SseStream
from cadenza.gateway.state import GatewayState, RequestError, tenant_salt
from cadenza.request_limits import RequestLimits, check_bad_word_count, presented_key
from cadenza.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class OpenAIHttp:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.state.model_name, "object": "model", "created": 0, "owned_by": "cadenza",
            "max_model_len": self.state.engine.max_model_len,
        }  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest)

    async def _serve(self, request: Request, kind: type[Body]) -> Response:
        try:  # the API key, Host and Origin were checked by http_guard.HttpGuard
            body = await read_json(request, kind, self.state.settings)
        except BodyError as e:
            return error_response(e.status, str(e), e.code)
        try:
            priority = request_priority(body.priority, body.service_tier, request.headers, self.state.settings)
            bodies = self._per_prompt(body)
        except RequestError as e:
            return _refusal(e)
        runs = await self._admit_all(request, bodies, priority)
        if isinstance(runs, Response):
            return runs
        run = runs[0] if len(runs) == 1 else BatchRun(runs, body.n)  # type: ignore[arg-type]
        headers = _ignored_header(body)
        if body.stream:
            settings = self.state.settings
            return SseStream(run.sse(), settings.send_timeout_s, run.close_stream, headers, settings.sse_keep_alive_s)
        try:
            return JSONResponse(await run.whole(), headers=headers)
        except (RequestFailedError, EngineDeadError) as e:
            return error_response(500, str(e), "server_error")
        except ValueError as e:
            return error_response(400, str(e), "invalid_request")
        finally:
            run.release()

    def _per_prompt(self, body: Body) -> list[Body]:
        """One body per prompt of a completions batch (the request itself otherwise)."""
        if not isinstance(body, CompletionRequest):
            return [body]
        prompts, limit = body.prompts, self.state.settings.max_prompts_per_request
        if len(prompts) > limit:
            message = f"{len(prompts)} prompts in one request; at most {limit} (max_prompts_per_request)"
            raise RequestError(message, "invalid_request", "prompt")
        return [msgspec.structs.replace(body, prompt=p) for p in prompts]

    async def _admit_all(self, request: Request, bodies: list[Body], priority: int) -> list[OpenAIRun] | Response:
        """A run per prompt, each holding its own admission place (a batch is that many
        requests); a refusal of any, or a cancel, gives back the places already taken."""
        runs: list[OpenAIRun] = []
        done = False
        try:
            for body in bodies:
                admitted = await self._admit(request, body, priority)
                if isinstance(admitted, Response):
                    return admitted
                runs.append(admitted)
            done = True
            return runs
        finally:
            if not done:
                for run in runs:
                    run.close_stream() if run.body.stream else run.release()

    async def _admit(self, request: Request, body: Body, priority: int) -> OpenAIRun | Response:
        """A run holding its admission place, or the refusal."""
        admission = self.state.admission
        client = admission.client(request.client and request.client.host)
        refused = admission.admit(client, body.stream)  # before the template and tokenizer run
        if refused is not None:
            code, message = refused
            return error_response(429, message, code, **RETRY_AFTER)
        prepared = False
        try:  # templates and tokenizers are CPU work: off the event loop every socket shares
            chat = isinstance(body, ChatCompletionRequest)
            prompt_ids, params, tools = await asyncio.to_thread(self._prepare, body, chat)
            grammar = await self.state.grammars.admit(client, params)  # compiled in a thread, in budget
            prepared = True
        except Exception as e:
            return _refusal(e)
        finally:  # a failure, or a cancel: under Serve a client that leaves cancels this task, here
            if not prepared:
                admission.give_back(client, body.stream)
        salt = tenant_salt(presented_key(request.headers), body.cache_salt)
        return self._run(body, Admitted(prompt_ids, params, client, grammar, priority, salt), tools, request.headers)

    def _run(
        self, body: Body, admitted: Admitted, tools: tool_choice.ToolPlan | None, headers: Mapping[str, str]
    ) -> OpenAIRun:
        if isinstance(body, ChatCompletionRequest):
            return ChatRun(self.state, body, admitted, headers, tools)
        return CompletionRun(self.state, body, admitted, headers)

    def _prepare(self, body: Body, chat: bool) -> tuple[list[int], SamplingParams, tool_choice.ToolPlan | None]:
        state = self.state
        state.check_model(body.model)
        state.check_session_key(body.prompt_cache_key)
        tokenizer = state.tokenizer
        tools = None
        if chat:
            prompt_ids, tools = self._chat_prompt(body)
        elif isinstance(body.prompt, str):
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        if body.truncate_prompt_tokens is not None:  # vLLM: the last k tokens (the recent context)
            prompt_ids = prompt_ids[-body.truncate_prompt_tokens :]
        prompt = "messages" if chat else "prompt"
        # OpenAI's defaults when max_tokens is not given: the server's for chat, 16 for completions.
        default = state.settings.default_max_output_tokens if chat else 16
        max_tokens = state.max_tokens(len(prompt_ids), body.requested_max_tokens, default, (prompt, "max_tokens"))
        params = body.sampling_params(max_tokens, body.num_logprobs, _grammar(body, tools), state.sampling_defaults)
        params.bad_words_token_ids = _bad_word_ids(tokenizer, body.bad_words, state.engine.request_limits)
        if tools is not None and tools.mode == "auto" and tools.parser != "hermes":
            params.skip_special_tokens = False  # [TOOL_CALLS] and <|python_tag|> are special tokens
        state.check(params, prompt_ids, prompt)  # an empty prompt included
        return prompt_ids, params, tools

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], tool_choice.ToolPlan | None]:
        state, tokenizer = self.state, self.state.tokenizer
        if not body.messages:
            raise RequestError("messages must not be empty", "invalid_request", "messages")
        if len(body.messages) > state.settings.max_messages:
            message = f"{len(body.messages)} messages; at most {state.settings.max_messages} (max_messages)"
            raise RequestError(message, "invalid_request", "messages")
        tools, shown = tool_choice.plan(body, state.tool_parser)
        messages, variables = tool_choice.messages(body, shown, tokenizer.chat_template)
        variables = {**variables, **(body.chat_template_kwargs or {})}
        # Special-token text in a message's content stays text (no spoofed turns).
        chat = tokenizer.render_chat(messages, body.add_generation_prompt, variables)
        if body.continue_final_message:
            chat = _continued(chat, messages)
        return tokenizer.encode_chat(chat, add_special_tokens=body.add_special_tokens), tools


def _bad_word_ids(tokenizer: Any, words: list[str] | None, limits: RequestLimits) -> list[list[int]]:
    """vLLM's rule: each word as it would start the text and after a space. Counted before
    any is tokenized (their tokens are counted by state.check)."""
    if any(not w for w in words or []):
        raise RequestError("bad_words must not be empty strings", "invalid_request", "bad_words")
    try:
        check_bad_word_count(len(words or []), limits)
    except ValueError as e:
        raise RequestError(str(e), "invalid_request", "bad_words") from None
    variants = {
        tuple(tokenizer.encode(v, add_special_tokens=False)) for w in words or [] for v in (w, " " + w.lstrip())
    }
    return [list(v) for v in sorted(variants) if v]


def _grammar(body: Body, tools: tool_choice.ToolPlan | None) -> Any:
    return combined(requested_grammar(body), tool_choice.grammar(tools, body))


def _refusal(error: Exception) -> Response:
    """The answer to a request that could not be prepared: its own content is the cause (a
    template that raises on it included), so a 4xx with the reason, never a 500."""
    if isinstance(error, RequestError):
        status = 404 if error.code == "model_not_found" else error.status
        retry = RETRY_AFTER if status == 429 else {}
        return error_response(status, str(error), error.code, error.param, **retry)
    if not isinstance(error, ValueError):
        log.warning("preparing a request failed: %s: %s", type(error).__name__, error)
    return error_response(400, f"the request could not be prepared: {error}", "invalid_request")


def _continued(chat: Any, messages: list[dict[str, str]]) -> Any:
    """The rendered conversation (a RenderedChat) cut right after the final assistant message's
    content, so the model continues that message rather than starting a new turn (vLLM's
    continue_final_message)."""
    last = messages[-1]
    end = chat.text.rfind(last["content"]) if last["role"] == "assistant" and last["content"] else -1
    if end < 0:
        message = "continue_final_message needs a final assistant message with content"
        raise RequestError(message, "invalid_request", "messages")
    return chat.cut(end + len(last["content"]))


IGNORED_HEADER = "x-cadenza-ignored-fields"


def _ignored_header(body: Body) -> dict[str, str]:
    """Fields accepted without effect here (openai_schema.IGNORED), named back to the client."""
    ignored = body.ignored_fields()
    if not ignored:
        return {}
    log.info("accepted without effect: %s", ", ".join(ignored))
    return {IGNORED_HEADER: ",".join(ignored)}
