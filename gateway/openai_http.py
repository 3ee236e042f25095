"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions (SSE or whole), /v1/models.

Same engine, API key, limits and error shape as the websocket. Over capacity is a 429
with Retry-After before any work starts; a client that disconnects mid-stream has its
request aborted (the SSE generator is closed, which closes the engine stream), and so has
one that stops reading, once a send waits past send_timeout_s (send_deadline.SseStream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.gateway import tool_choice
from cadenza.gateway.admission import RETRY_AFTER
from cadenza.gateway.grammar_budget import GrammarPlace
from cadenza.gateway.http_guard import BodyError, error_response, read_json
from cadenza.gateway.logprob_entries import LogprobEntries, completion_logprobs
from cadenza.gateway.observe import Observation
from cadenza.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from cadenza.gateway.response_format import combined, requested_grammar
from cadenza.gateway.scheduling import request_priority
from cadenza.gateway.send_deadline import SseStream
from cadenza.gateway.state import GatewayState, RequestError, new_id, tenant_salt
from cadenza.gateway.stream_tally import StreamTally
from cadenza.outputs import RequestOutput
from cadenza.request_limits import RequestLimits, check_bad_word_count, presented_key

Body = ChatCompletionRequest | CompletionRequest
log = logging.getLogger(__name__)


class OpenAIHttp:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def models(self, request: Request) -> Response:
        card = {"id": self.state.model_name, "object": "model", "created": 0, "owned_by": "cadenza"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, chat=False)

    async def _serve(self, request: Request, kind: type[Body], chat: bool) -> Response:
        try:  # the API key, Host and Origin were checked by http_guard.HttpGuard
            body = await read_json(request, kind, self.state.settings)
        except BodyError as e:
            return error_response(e.status, str(e), e.code)
        try:
            priority = request_priority(body.priority, body.service_tier, request.headers, self.state.settings)
        except RequestError as e:
            return _refusal(e)
        admission = self.state.admission
        client = admission.client(request.client and request.client.host)
        refused = admission.admit(client, body.stream)  # before the template and tokenizer run
        if refused is not None:
            code, message = refused
            return error_response(429, message, code, **RETRY_AFTER)
        prepared = False
        try:  # templates and tokenizers are CPU work: off the event loop every socket shares
            prompt_ids, params, tools = await asyncio.to_thread(self._prepare, body, chat)
            grammar = await self.state.grammars.admit(client, params)  # compiled in a thread, in budget
            prepared = True
        except Exception as e:
            return _refusal(e)
        finally:  # a failure, or a cancel: under Serve a client that leaves cancels this task, here
            if not prepared:
                admission.give_back(client, body.stream)
        run = _Run(self.state, body, chat, prompt_ids, params)
        run.tools, run.priority = tools, priority
        run.client, run.grammar = client, grammar
        run.cache_salt = tenant_salt(presented_key(request.headers), body.cache_salt)
        operation = "chat" if chat else "text_completion"
        run.tally = StreamTally(Observation(self.state.metrics, self.state.tracing, operation, request.headers, params))
        headers = _ignored_header(body)
        if body.stream:
            return SseStream(run.sse(), self.state.settings.send_timeout_s, run.close_stream, headers)
        try:
            return JSONResponse(await run.whole(), headers=headers)
        except (RequestFailedError, EngineDeadError) as e:
            return error_response(500, str(e), "server_error")
        except ValueError as e:
            return error_response(400, str(e), "invalid_request")
        finally:
            run.release()

    def _prepare(self, body: Body, chat: bool) -> tuple[list[int], Any, tool_choice.ToolPlan | None]:
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
        params = body.sampling_params(max_tokens, body.num_logprobs, _grammar(body, tools))
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


class _Run:
    """One HTTP request's trip through the engine, as SSE chunks or one JSON body."""

    def __init__(self, state: GatewayState, body: Body, chat: bool, prompt_ids: list[int], params: Any) -> None:
        self.state, self.body, self.chat = state, body, chat
        self.prompt_ids, self.params = prompt_ids, params
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.tally: StreamTally | None = None  # set by the route, with its Observation
        self.cache_salt: str | None = None
        self.client = ""  # whose admission place this run holds
        self.grammar = GrammarPlace()  # its places in the grammar quota, given back with the other
        self.released = False
        # Completions' echo: the prompt (and its logprobs) go first; echo_only drops the output.
        self.echo = not chat and body.echo
        self.echo_only = self.echo and body.echo_only
        self.tools: tool_choice.ToolPlan | None = None  # set by the route: calls read from the reply
        self.priority = 0  # set by the route (gateway/scheduling.py)
        self.logprobs = LogprobEntries(state.tokenizer, params.logprobs, body.return_tokens_as_token_ids)

    async def _deltas(self) -> AsyncIterator[RequestOutput]:
        state, body = self.state, self.body
        stream = state.generate(
            self.prompt_ids, self.params, self.id, body.stream, self.cache_salt, self.priority, body.prompt_cache_key
        )
        tally = self.tally
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    tally.add(delta)
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or was cut: aborted
            tally.finish(self.id, len(self.prompt_ids), ["abort"])
            raise
        except BaseException as e:
            tally.fail(e)
            raise
        finally:
            self.release()
        tally.finish(self.id, len(self.prompt_ids))

    def release(self) -> None:
        """Give the admission place back, once, whichever path ends the run first."""
        if not self.released:
            self.released = True
            self.state.admission.release(self.client)
            self.grammar.release()

    def close_stream(self) -> None:
        """The end of its SSE response, however it came: the place (when the engine work has
        not given it back already) and the stream."""
        self.release()
        self.state.admission.close_stream(self.client)

    def usage(self) -> dict[str, Any]:
        prompt, completion = len(self.prompt_ids), 0 if self.echo_only else self.tally.completion_tokens
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.tally.cached_tokens},
        }
        if self.state.speculative:  # OpenAI's Predicted Outputs fields, for the model's own drafts
            spec = self.tally.observation.acceptance()
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": spec["num_accepted_tokens"],
                "rejected_prediction_tokens": spec["num_draft_tokens"] - spec["num_accepted_tokens"],
            }
        return usage

    async def whole(self) -> dict[str, Any]:
        logprobs: dict[int, list] = {}  # texts and finish reasons are the tally's
        echoed: tuple[str, list] | None = None
        first: RequestOutput | None = None
        async for delta in self._deltas():
            first = first or delta
            out = delta.outputs[0]
            echoed = echoed or (self._echoed(delta) if self.echo else None)
            logprobs.setdefault(out.index, []).extend(self.logprobs.of_output(out))
        texts, reasons = dict(self.tally.texts), self.tally.reasons
        if echoed is not None:
            prompt_text, prompt_entries = echoed
            for i in texts:
                kept_text, kept_entries = ("", []) if self.echo_only else (texts[i], logprobs[i])
                texts[i], logprobs[i] = prompt_text + kept_text, prompt_entries + kept_entries
        choices = [self._choice(i, texts[i], logprobs[i], reasons.get(i), final=True) for i in sorted(texts)]
        body = self._envelope(choices, usage=self.usage())
        if self.body.prompt_logprobs is not None:
            positions = (first.prompt_logprobs if first else None) or [None] * len(self.prompt_ids)
            body["prompt_logprobs"] = self.logprobs.vllm_prompt_logprobs(positions)
        return body

    def _echoed(self, delta: RequestOutput) -> tuple[str, list[dict[str, Any]]]:
        """The prompt's text and, when logprobs were asked, an entry per prompt token (the
        first has no logprob: nothing predicts it)."""
        prompt = self.body.prompt if isinstance(self.body.prompt, str) else self.state.tokenizer.decode(self.prompt_ids)
        if self.params.logprobs is None:
            return prompt, []
        positions = delta.prompt_logprobs or [None] * len(self.prompt_ids)
        return prompt, self.logprobs.of_prompt(self.prompt_ids, positions)

    async def sse(self) -> AsyncIterator[str]:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        running = bool(options and options.continuous_usage_stats)  # vLLM: usage in every chunk
        deltas = self._deltas()
        try:
            if self.chat:  # OpenAI opens each choice with its role
                for i in range(self.params.n):
                    opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield _sse(self._envelope([{**opening, "logprobs": None}], chunk=True))
            echo = self.echo
            tool_streams: dict[int, tool_choice.ToolDeltas] = {}
            async for delta in deltas:
                out = delta.outputs[0]
                if echo:  # the prompt first, once, in a chunk of its own
                    echo = False
                    text, entries = self._echoed(delta)
                    reason = "length" if self.echo_only else None
                    yield _sse(self._envelope([self._choice(0, text, entries, reason, final=False)], chunk=True))
                if self.echo_only or not (out.text or out.finish_reason):
                    continue
                if self.tools is not None:
                    for chunk in self._tool_chunks(out, tool_streams):
                        yield _sse(self._envelope([chunk], usage=self.usage() if running else None, chunk=True))
                    continue
                choice = self._choice(out.index, out.text, self.logprobs.of_output(out), out.finish_reason, final=False)
                yield _sse(self._envelope([choice], usage=self.usage() if running else None, chunk=True))
            if include_usage:
                yield _sse(self._envelope([], usage=self.usage(), chunk=True))
        except (RequestFailedError, EngineDeadError, ValueError) as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": "server_error"}})
        finally:  # a stream cut at a yield aborts its engine request now, not at garbage collection
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    def _envelope(self, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        model = self.state.model_name
        body = {"id": self.id, "object": obj, "created": self.created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def _tool_chunks(self, out: Any, streams: dict[int, tool_choice.ToolDeltas]) -> list[dict[str, Any]]:
        """A streamed choice's chunks under tools: content and tool_calls deltas, then the end."""
        deltas = streams.setdefault(out.index, tool_choice.ToolDeltas(self.tools))
        parts = deltas.feed(out.text) + (deltas.finish() if out.finish_reason else [])
        chunks = [{"index": out.index, "delta": part, "logprobs": None, "finish_reason": None} for part in parts]
        if out.finish_reason:
            finish = self._finish(out.finish_reason, deltas.called)
            chunks.append({"index": out.index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return chunks

    def _finish(self, reason: str | None, called: bool = False) -> str | None:
        """OpenAI's finish_reason: tool_calls when the model chose to call (a forced named
        function ends with stop, as OpenAI's does)."""
        if reason == "length" or not reason:
            return reason
        return "tool_calls" if called and self.tools is not None and self.tools.mode != "named" else "stop"

    def _message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": text}, self._finish(reason)
        content, calls = self.tools.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, self._finish(reason)
        message = {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
        return message, self._finish(reason, called=True)

    def _choice(self, index: int, text: str, logprobs: list, reason: str | None, final: bool) -> dict[str, Any]:
        finish = self._finish(reason)
        wants = self.params.logprobs is not None
        if self.chat:
            lp = {"content": logprobs} if wants else None
            if final:
                message, finish = self._message(text, reason)
                return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
            return {"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": finish}
        lp = completion_logprobs(logprobs) if wants else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
