"""The event sequence of one response, from response.created to its terminal event
(`response.completed`, `response.incomplete` or `response.failed`), whatever ends it: the
last token, a cancel, a steer, a closed socket or any failure. Every event goes to the
response's log (for replay) and to its transport: the websocket it was created on, or
nothing over HTTP, whose readers follow the log.

Output items are numbered as they open. Without a reasoning parser the message opens at
once (output 0); with one (`--reasoning-parser`), a reply that thinks first opens a
`reasoning` item (its text in response.reasoning_text.delta events) and the message opens
with the first text of the answer; function calls follow the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.gateway import protocol as p
from cadenza.gateway.log_messages import Adoption, ReissueSpec, decode_delta
from cadenza.gateway.observe import Observation
from cadenza.gateway.reasoning import ReasoningTally
from cadenza.gateway.response_store import StoredResponse
from cadenza.gateway.state import GatewayState, PreparedResponse
from cadenza.gateway.stream_tally import StreamTally
from cadenza.gateway.tool_calls import ToolCall
from cadenza.gateway.tool_choice import ToolDeltas
from cadenza.outputs import RequestOutput

if TYPE_CHECKING:  # the socket owns its runs; only the types cross back
    from cadenza.gateway.responses_ws import Job


class Transport(Protocol):
    """Where a run's events go besides its log (responses_ws.ResponsesSocket, or
    responses_http's log-only transport)."""

    state: GatewayState
    headers: Any
    direct: bool  # sends events itself (a socket): under Serve, each waits for the shared log

    async def send(self, event: p.Json, stream_id: str | None = None) -> None: ...


log = logging.getLogger(__name__)


class ResponseRun:
    """The event sequence of one response, from response.created to its terminal event."""

    def __init__(
        self, transport: Transport, job: Job, prepared: PreparedResponse, adoption: Adoption | None = None
    ) -> None:
        """adoption: a response another replica started and died running (shared_log.py): its
        deltas are replayed, its events so far are not sent again, and the engine goes on."""
        self.transport, self.job, self.prepared = transport, job, prepared
        self.sid = job.create.stream_id
        # Item ids follow from the response's, so a re-issue names its items as the original did.
        self.item_id = "msg_" + _suffix(prepared.response_id)
        state = transport.state
        self.replay: list[RequestOutput] = []
        self.skip = 0  # events the log holds already (a re-issue regenerates them)
        self.cancel_after_replay = False
        if adoption is not None:
            self.created_at = adoption.spec.created_at
            self.log = state.logs.restore(adoption)
            self.replay = [decode_delta(d) for d in adoption.deltas]
            self.skip = adoption.count
        else:
            self.created_at = p.now()
            self.log = state.logs.open(prepared.response_id, prepared.tenant, self._spec())  # for replay
        self.log.cancel = self.cancel
        self.tally = StreamTally(Observation(state.metrics, state.tracing, "chat", transport.headers, prepared.params))
        self.tally.observation.span.messages(prepared.messages)
        # Tools: under auto the reply's content streams and its calls are read as it goes;
        # a grammar-made reply (required, a named function) is all calls, read at the end.
        tools = prepared.tools
        self.tool_stream = ToolDeltas(tools) if tools is not None and tools.mode == "auto" else None
        self.content = ""  # what was streamed as text (the reply less its calls, under tools)
        self.calls: list[ToolCall] = []
        parser = state.reasoning_parser
        self.reasoning = ReasoningTally(parser) if parser else None
        self.thinking = ""  # the reasoning text streamed
        self.outputs = 0  # output items opened so far: the next one's output_index
        self.reasoning_ref: p.Json | None = None  # output_index / item_id / content_index while open
        self.reasoning_output: list[p.Json] = []  # the reasoning item once closed
        self.message_ref: p.Json | None = None

    def response(self, status: str, output: list[p.Json], **fields: Any) -> p.Json:
        r = p.response_object(
            self.prepared.response_id, self.transport.state.model_name, status, self.job.create, output, self.created_at
        )
        return {**r, **(self.prepared.echo or {}), **fields}

    def _spec(self) -> ReissueSpec | None:
        """What re-issues this response on another replica, where a shared log can (Serve)."""
        if not self.transport.state.logs.shared:
            return None
        create = msgspec.json.encode(self.job.create)
        return ReissueSpec(create, self.prepared.tenant, self.prepared.priority, self.created_at)

    async def emit(self, event: p.Json) -> None:
        if self.skip:  # a re-issue's replay: the log (and its clients) have this event already
            self.skip -= 1
            return
        self.log.append(event)
        if self.transport.direct:
            await self.log.wait_durable(self.log.count)
        await self.transport.send(event, self.sid)

    def cancel(self) -> None:
        """A cancel from outside its socket (HTTP); past its stream it completes as it is. A
        re-issue's replay is not cut (its events must be the log's): the cancel waits for its end."""
        if self.skip or self.replay:
            self.cancel_after_replay = True
            return
        task = self.job.task
        if task is not None and not task.done() and not self.job.finishing:
            task.cancel()

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.log.finish()

    async def _run(self) -> None:
        try:
            finish = await self.open_and_stream()
            self.job.finishing = True
            self.tally.finish(self.prepared.response_id, len(self.prepared.prompt_ids), [finish])
            await self.finish(finish)
        except Exception as e:  # the engine, a double, our own code: it ends this response only
            self.tally.fail(e)
            await self.fail(e)

    async def open_and_stream(self) -> str:
        """From response.created to the last delta: a cancel or steer anywhere in here (before the
        first token included) ends the response with its terminal event."""
        try:
            await self.emit({"type": "response.created", "response": self.response("in_progress", [])})
            await self.emit({"type": "response.in_progress", "response": self.response("in_progress", [])})
            if self.reasoning is None:
                await self.open_message()
            return await self.stream()
        except asyncio.CancelledError:
            return "steered" if self.job.steer_input is not None else "cancelled"

    async def open_message(self) -> p.Json:
        """The message item's reference, opening it (output_item.added, content_part.added) first;
        the thinking, if any, is over then: its item closes first."""
        if self.message_ref is None:
            await self.close_reasoning("completed")
            self.message_ref = {"output_index": self.outputs, "item_id": self.item_id, "content_index": 0}
            self.outputs += 1
            added = p.message_item(self.item_id, "", "in_progress")
            await self.emit({"type": "response.output_item.added", "output_index": self.outputs - 1, "item": added})
            await self.emit({"type": "response.content_part.added", **self.message_ref, "part": p.text_part("")})
        return self.message_ref

    async def think(self, text: str, extras: p.Json) -> None:
        """Thinking text, into the reasoning item (opened on its first text)."""
        if self.reasoning_ref is None:
            item_id = "rs_" + _suffix(self.prepared.response_id)
            self.reasoning_ref = {"output_index": self.outputs, "item_id": item_id, "content_index": 0}
            self.outputs += 1
            added = p.reasoning_item(self.reasoning_ref["item_id"], "", "in_progress")
            await self.emit({"type": "response.output_item.added", "output_index": self.outputs - 1, "item": added})
            part = {"type": "reasoning_text", "text": ""}
            await self.emit({"type": "response.content_part.added", **self.reasoning_ref, "part": part})
        self.thinking += text
        event = {"type": "response.reasoning_text.delta", **self.reasoning_ref, "delta": text, p.EXTRA_KEY: extras}
        await self.emit(event)

    async def stream(self) -> str:
        state = self.transport.state
        async with contextlib.aclosing(self.deltas()) as stream:  # on cancel, abort the engine request now, not at GC
            async for delta in stream:
                out = self.tally.add(delta)
                extras: p.Json = {"token_ids": out.token_ids}
                if state.speculative:  # how many of these tokens were drafts the model accepted
                    extras["accepted_tokens"] = out.num_accepted_tokens
                if out.logprobs:
                    extras["logprobs"] = [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.logprobs]
                text, thought = out.text, ""
                if self.reasoning is not None:
                    self.reasoning.add(out)
                    thought, text = self.reasoning.latest.pop(out.index, ("", text))
                    if thought:
                        await self.think(thought, extras)
                text = self._visible(text, bool(out.finish_reason))
                if text or (out.token_ids and not thought and (self.reasoning is None or self.message_ref)):
                    ref = await self.open_message()
                    event = {"type": "response.output_text.delta", **ref, "delta": text, "logprobs": []}
                    await self.emit({**event, p.EXTRA_KEY: extras})
        return self.tally.reasons.get(0, "stop")  # one sequence: the websocket has no n

    async def deltas(self) -> AsyncIterator[RequestOutput]:
        """The engine's deltas, each recorded for a re-issue; a re-issue's recorded ones first,
        then the engine's continuation after the tokens they hold."""
        replay, self.replay = self.replay, []
        for delta in replay:
            yield delta
        if self.cancel_after_replay:
            raise asyncio.CancelledError  # ends as a cancel does, now that its events match the log's
        if replay and replay[-1].finished:
            return
        prepared = self.prepared
        emitted = [t for d in replay for t in d.outputs[0].token_ids]
        stream = self.transport.state.generate(
            prepared.prompt_ids,
            prepared.params,
            prepared.response_id,
            True,
            prepared.tenant,  # the prefix-cache salt, and the tenant the engine pins its session for
            prepared.priority,
            prepared.session_id,
            resume_from=emitted or None,
        )
        async with contextlib.aclosing(stream):
            async for delta in stream:
                self.log.record(delta)
                yield delta

    def _visible(self, text: str, last: bool) -> str:
        """The part of a delta that is content (all of it without tools)."""
        tools = self.prepared.tools
        if tools is None:
            self.content += text
            return text
        if self.tool_stream is None:  # grammar-made: nothing streams as text
            if last:
                self.calls = tools.parse(self.tally.text)[1]
            return ""
        parts = self.tool_stream.feed(text) + (self.tool_stream.finish() if last else [])
        shown = "".join(d.get("content") or "" for d in parts)
        self.calls = self.tool_stream.sent  # parallel_tool_calls: false keeps the first
        self.content += shown
        return shown

    async def finish(self, finish: str) -> None:
        """Terminal events; runs also after a cancel or steer (the socket may still be open)."""
        complete, text = finish == "stop", self.content
        item_status = "completed" if complete else "incomplete"
        await self.close_reasoning(item_status)  # a reply cut off while thinking
        item = await self.open_message()  # a reply with no answer text still has its message
        await self.emit({"type": "response.output_text.done", **item, "text": text, "logprobs": []})
        await self.emit({"type": "response.content_part.done", **item, "part": p.text_part(text)})
        message = p.message_item(self.item_id, text, item_status)
        await self.emit({"type": "response.output_item.done", "output_index": item["output_index"], "item": message})
        calls = await self.emit_calls(item_status)
        turn: p.Json = {"role": "assistant", "content": text}
        if self.calls:
            turn["tool_calls"] = [c.to_openai() for c in self.calls]
        prepared = self.prepared  # the store keeps this response's own turn: its input and reply
        own = prepared.messages[prepared.history_len :] + [turn]
        await self.transport.state.store.put(
            StoredResponse.of(prepared.response_id, own, prepared.parent, prepared.session_id, prepared.tenant)
        )
        reason = {"length": "max_output_tokens", "steered": "steered"}.get(finish)
        status = "completed" if complete else ("cancelled" if finish == "cancelled" else "incomplete")
        reasoning_tokens = self.reasoning.tokens if self.reasoning is not None else 0
        tally = self.tally
        fields = {
            "usage": p.usage(len(prepared.prompt_ids), tally.cached_tokens, tally.completion_tokens, reasoning_tokens),
            "incomplete_details": {"reason": reason} if reason else None,
            "completed_at": int(p.now()) if complete else None,
            p.EXTRA_KEY: self.timings(),
        }
        kind = "response.completed" if complete else "response.incomplete"
        output = [*self.reasoning_output, message, *calls]
        await self.emit({"type": kind, "response": self.response(status, output, **fields)})

    async def close_reasoning(self, status: str) -> None:
        """The reasoning item's closing events, where one is open."""
        ref, self.reasoning_ref = self.reasoning_ref, None
        if ref is None:
            return
        part = {"type": "reasoning_text", "text": self.thinking}
        await self.emit({"type": "response.reasoning_text.done", **ref, "text": self.thinking})
        await self.emit({"type": "response.content_part.done", **ref, "part": part})
        item = p.reasoning_item(ref["item_id"], self.thinking, status)
        await self.emit({"type": "response.output_item.done", "output_index": ref["output_index"], "item": item})
        self.reasoning_output = [item]

    async def emit_calls(self, status: str) -> list[p.Json]:
        """Each function call as an output item after the message, with its argument events."""
        items = []
        for index, call in enumerate(self.calls, start=self.outputs):
            item_id = f"fc_{_suffix(self.prepared.response_id)}_{index}"
            ref = {"output_index": index, "item_id": item_id}
            opened = p.function_call_item(item_id, call.id, call.name, "", "in_progress")
            await self.emit({"type": "response.output_item.added", "output_index": index, "item": opened})
            await self.emit({"type": "response.function_call_arguments.delta", **ref, "delta": call.arguments})
            await self.emit({"type": "response.function_call_arguments.done", **ref, "arguments": call.arguments})
            done = p.function_call_item(item_id, call.id, call.name, call.arguments, status)
            await self.emit({"type": "response.output_item.done", "output_index": index, "item": done})
            items.append(done)
        return items

    async def fail(self, e: Exception) -> None:
        """The engine's own failures are shown as they are; anything else is logged, not shown."""
        if isinstance(e, (RequestFailedError, EngineDeadError, ValueError)):
            message = str(e)
        else:
            log.error("response %s failed", self.prepared.response_id, exc_info=e)
            message = "the server failed while producing this response"
        error = {"code": "server_error", "message": message}
        await self.emit({"type": "response.failed", "response": self.response("failed", [], error=error)})

    def timings(self) -> p.Json:
        """From the observation, which saw the same deltas (one clock for metrics and extras),
        with the speculative acceptance when the engine speculates."""
        obs, tokens = self.tally.observation, self.tally.completion_tokens
        first = obs.first_token_at
        decode = time.time() - first if first else 0.0
        rate = (tokens - 1) / decode if decode > 0 and tokens > 1 else None
        timings = {
            "ttft_s": None if first is None else first - obs.arrival,
            "tokens_per_s": rate,
            "cached_tokens": self.tally.cached_tokens,
        }
        return {**timings, **obs.acceptance()} if self.transport.state.speculative else timings


def _suffix(response_id: str) -> str:
    """The unique part of a response id (`resp_<hex>`): its items' ids are built from it."""
    return response_id.partition("_")[2] or response_id
