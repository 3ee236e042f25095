"""One websocket on /v1/responses: lanes, responses, steering and cancellation.

A lane (`stream_id`) runs its responses one after another; lanes run at once. Each
response runs as its own task, so `response.cancel`, a steer or a closed socket stops it
wherever it is (waiting for its first token included), which aborts the engine request
and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cadenza.gateway import protocol as p
from cadenza.gateway.admission import RETRY_AFTER_MS
from cadenza.gateway.observe import Observation
from cadenza.gateway.state import GatewayState, PreparedResponse, RequestError, new_id, presented_key, tenant_salt
from starlette.websockets import WebSocket, WebSocketDisconnect

from cadenza.async_llm import EngineDeadError, RequestFailedError


@dataclass(eq=False)
class Job:
    create: p.ResponseCreate
    response_id: str | None = None  # known once the response starts
    task: asyncio.Task[None] | None = None
    steer_input: list[dict[str, str]] | None = None  # set by response.steer


@dataclass(eq=False)
class Lane:
    stream_id: str | None
    jobs: deque[Job] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None


class ResponsesSocket:
    def __init__(self, ws: WebSocket, state: GatewayState) -> None:
        self.ws = ws
        self.state = state
        self.lanes: dict[str | None, Lane] = {}
        self.active: dict[str, Job] = {}  # response id -> running job
        self.job_tasks: set[asyncio.Task[None]] = set()  # started jobs, from their first moment
        self.pending = 0  # responses admitted on this socket and not yet finished
        self.seq = 0
        self.send_lock = asyncio.Lock()
        self.closed = False

    async def send(self, event: p.Json, stream_id: str | None = None) -> None:
        if self.closed:
            return
        async with self.send_lock:
            event = {**event, "sequence_number": self.seq}
            if stream_id is not None:
                event["stream_id"] = stream_id
            self.seq += 1
            try:
                await self.ws.send_text(p.encode(event).decode())
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True

    async def serve(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                frame = message.get("text") if message.get("text") is not None else message.get("bytes")
                await self.on_frame(frame or "")
        finally:
            self.closed = True
            await self.stop_all()

    async def on_frame(self, frame: str | bytes) -> None:
        if len(frame) > self.state.settings.max_frame_bytes:
            limit = self.state.settings.max_frame_bytes
            await self.send(p.error_event(f"message of {len(frame)} bytes exceeds {limit}", "frame_too_large"))
            return
        try:
            event = p.decode_client_event(frame)
        except ValueError as e:
            code = "unknown_event_type" if str(e).startswith("unknown") else "invalid_event"
            await self.send(p.error_event(str(e), code))
            return
        if isinstance(event, p.ResponseCreate):
            await self.on_create(event)
        elif isinstance(event, p.ResponseSteer):
            await self.on_steer(event)
        else:
            await self.on_cancel(event)

    async def on_create(self, create: p.ResponseCreate) -> None:
        settings = self.state.settings
        if self.pending >= settings.max_responses_per_socket:
            message = f"this socket already has {self.pending} responses in flight (max_responses_per_socket)"
            await self.send(p.error_event(message, "too_many_responses", 429), create.stream_id)
            return
        if not self.state.admission.try_acquire():
            await self.send(
                p.error_event(
                    "the server is at capacity; retry shortly",
                    "server_overloaded",
                    429,
                    retry_after_ms=RETRY_AFTER_MS,
                    headers={"retry-after-ms": str(RETRY_AFTER_MS)},
                ),
                create.stream_id,
            )
            return
        self.pending += 1
        self.enqueue(Job(create), front=False)

    def enqueue(self, job: Job, front: bool) -> None:
        lane = self.lanes.get(job.create.stream_id)
        if lane is None:
            lane = self.lanes[job.create.stream_id] = Lane(job.create.stream_id)
            lane.runner = asyncio.get_running_loop().create_task(self.run_lane(lane))
        (lane.jobs.appendleft if front else lane.jobs.append)(job)
        lane.wake.set()

    async def run_lane(self, lane: Lane) -> None:
        while True:
            while not lane.jobs:
                lane.wake.clear()
                await lane.wake.wait()
            job = lane.jobs.popleft()
            job.task = asyncio.get_running_loop().create_task(self.run_job(job))
            self.job_tasks.add(job.task)
            try:
                await asyncio.shield(job.task)  # a cancelled response must not end its lane
            finally:
                self.job_tasks.discard(job.task)
                self.pending -= 1
                self.state.admission.release()

    async def on_steer(self, steer: p.ResponseSteer) -> None:
        job = self.active.get(steer.previous_response_id)
        info = {"previous_response_id": steer.previous_response_id}
        try:
            messages = p.input_messages(steer.input)
        except ValueError as e:
            messages, error = [], ("invalid_input", str(e))
        else:
            error = None if job is not None else ("response_not_active", "that response is not running here")
        if error or not messages:
            code, message = error or ("invalid_input", "steer input is empty")
            await self.send(
                {
                    "type": "response.steer.failed",
                    "error": {"type": "invalid_request_error", "code": code, "message": message},
                    "steer": {**info, "input": p.encode(steer.input).decode()},
                }
            )
            return
        job.steer_input = (job.steer_input or []) + messages
        await self.send({"type": "response.steer.accepted", "steer": {"id": new_id("steer"), **info}})
        if job.task is not None:
            job.task.cancel()

    async def on_cancel(self, cancel: p.ResponseCancel) -> None:
        job = self.active.get(cancel.response_id)
        if job is None or job.task is None:
            message = f"response {cancel.response_id!r} is not running on this socket"
            await self.send(p.error_event(message, "response_not_found", 404, "response_id"))
            return
        job.task.cancel()

    async def stop_all(self) -> None:
        for lane in self.lanes.values():  # queued, never started: give their places back
            for _ in lane.jobs:
                self.pending -= 1
                self.state.admission.release()
            lane.jobs.clear()
        tasks = [lane.runner for lane in self.lanes.values() if lane.runner]
        tasks += list(self.job_tasks)  # including jobs created but not yet started
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def run_job(self, job: Job) -> None:
        create, sid = job.create, job.create.stream_id
        try:
            prepared = self.state.prepare(create)
        except RequestError as e:
            await self.send(p.error_event(str(e), e.code, 400, e.param), sid)
            return
        job.response_id = prepared.response_id
        self.active[prepared.response_id] = job
        try:
            await ResponseRun(self, job, prepared).run()
        finally:
            self.active.pop(prepared.response_id, None)
        if job.steer_input is not None:  # the successor continues from the steered response
            successor = p.ResponseCreate(
                model=create.model,
                input=[p.InputMessage(role=m["role"], content=m["content"]) for m in job.steer_input],
                instructions=create.instructions,
                max_output_tokens=create.max_output_tokens,
                temperature=create.temperature,
                top_p=create.top_p,
                top_logprobs=create.top_logprobs,
                previous_response_id=prepared.response_id,
                stream_id=sid,
                cache_salt=create.cache_salt,
            )
            self.state.admission.acquire()
            self.pending += 1
            self.enqueue(Job(successor), front=True)


class ResponseRun:
    """The event sequence of one response, from response.created to its terminal event."""

    def __init__(self, socket: ResponsesSocket, job: Job, prepared: PreparedResponse) -> None:
        self.socket, self.job, self.prepared = socket, job, prepared
        self.sid = job.create.stream_id
        self.item_id = new_id("msg")
        self.created_at = p.now()
        self.text = ""
        self.cached_tokens = 0
        state = socket.state
        self.observation = Observation(state.metrics, state.tracing, "chat", socket.ws.headers, prepared.params)
        self.observation.span.messages(prepared.messages)

    def response(self, status: str, output: list[p.Json], **fields: Any) -> p.Json:
        r = p.response_object(
            self.prepared.response_id, self.socket.state.model_name, status, self.job.create, output, self.created_at
        )
        return {**r, **fields}

    async def emit(self, event: p.Json) -> None:
        await self.socket.send(event, self.sid)

    async def run(self) -> None:
        await self.emit({"type": "response.created", "response": self.response("in_progress", [])})
        await self.emit({"type": "response.in_progress", "response": self.response("in_progress", [])})
        item = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        await self.emit(
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": p.message_item(self.item_id, "", "in_progress"),
            }
        )
        await self.emit({"type": "response.content_part.added", **item, "part": p.text_part("")})
        try:
            finish = await self.stream(item)
        except asyncio.CancelledError:
            finish = "steered" if self.job.steer_input is not None else "cancelled"
        except (RequestFailedError, EngineDeadError, ValueError) as e:
            self.observation.fail(e)
            await self.fail(str(e))
            return
        prompt_tokens = len(self.prepared.prompt_ids)
        self.observation.finish(self.prepared.response_id, [finish], prompt_tokens, self.text)
        await self.finish(finish, item)

    async def stream(self, item: p.Json) -> str:
        state = self.socket.state
        finish = "stop"
        salt = tenant_salt(presented_key(self.socket.ws.headers), self.job.create.cache_salt)
        prepared = self.prepared
        stream = state.generate(prepared.prompt_ids, prepared.params, prepared.response_id, True, salt)
        async with contextlib.aclosing(stream):  # on cancel, abort the engine request now, not at GC
            async for delta in stream:
                out = delta.outputs[0]
                self.observation.delta(delta)
                self.cached_tokens = delta.num_cached_tokens
                if out.text or out.token_ids:
                    self.text += out.text
                    extras: p.Json = {"token_ids": out.token_ids}
                    if state.speculative:  # how many of these tokens were drafts the model accepted
                        extras["accepted_tokens"] = out.num_accepted_tokens
                    if out.logprobs:
                        extras["logprobs"] = [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.logprobs]
                    await self.emit(
                        {
                            "type": "response.output_text.delta",
                            **item,
                            "delta": out.text,
                            "logprobs": [],
                            p.EXTRA_KEY: extras,
                        }
                    )
                finish = out.finish_reason or finish
        return finish

    async def finish(self, finish: str, item: p.Json) -> None:
        """Terminal events; runs also after a cancel or steer (the socket may still be open)."""
        complete = finish == "stop"
        await self.emit({"type": "response.output_text.done", **item, "text": self.text, "logprobs": []})
        await self.emit({"type": "response.content_part.done", **item, "part": p.text_part(self.text)})
        item_status = "completed" if complete else "incomplete"
        message = p.message_item(self.item_id, self.text, item_status)
        await self.emit({"type": "response.output_item.done", "output_index": 0, "item": message})
        self.socket.state.store.put(
            self.prepared.response_id, self.prepared.messages + [{"role": "assistant", "content": self.text}]
        )
        reason = {"length": "max_output_tokens", "steered": "steered"}.get(finish)
        status = "completed" if complete else ("cancelled" if finish == "cancelled" else "incomplete")
        fields = {
            "usage": p.usage(len(self.prepared.prompt_ids), self.cached_tokens, self.observation.output_tokens),
            "incomplete_details": {"reason": reason} if reason else None,
            "completed_at": int(p.now()) if complete else None,
            p.EXTRA_KEY: self.timings(),
        }
        kind = "response.completed" if complete else "response.incomplete"
        await self.emit({"type": kind, "response": self.response(status, [message], **fields)})

    async def fail(self, message: str) -> None:
        error = {"code": "server_error", "message": message}
        await self.emit({"type": "response.failed", "response": self.response("failed", [], error=error)})

    def timings(self) -> p.Json:
        """From the observation, which saw the same deltas (one clock for metrics and extras),
        with the speculative acceptance when the engine speculates."""
        obs, tokens = self.observation, self.observation.output_tokens
        first = obs.first_token_at
        decode = time.time() - first if first else 0.0
        rate = (tokens - 1) / decode if decode > 0 and tokens > 1 else None
        timings = {
            "ttft_s": None if first is None else first - obs.arrival,
            "tokens_per_s": rate,
            "cached_tokens": self.cached_tokens,
        }
        return {**timings, **obs.acceptance()} if self.socket.state.speculative else timings
