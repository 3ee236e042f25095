"""One websocket on /v1/responses: lanes, responses, steering and cancellation.

A lane (`stream_id`) runs its responses one after another; lanes run at once. Each
response runs as its own task, so `response.cancel`, a steer or a closed socket stops it
wherever it is (waiting for its first token included), which aborts the engine request
and frees its KV blocks.

Nothing a client sends may hold a place for good or end a lane: a job's admission place is
given back once, by its task's done callback or when it is dropped from a queue; nothing is
queued once the socket is closed; every failure ends its response with an event; a lane
with no work left is retired; and a send that the client does not read within
send_timeout_s ends the socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from cadenza.gateway import protocol as p
from cadenza.gateway.admission import RETRY_AFTER_MS
from cadenza.gateway.grammar_budget import GrammarPlace
from cadenza.gateway.json_scan import JsonDepthError, check_json
from cadenza.gateway.response_run import ResponseRun
from cadenza.gateway.send_deadline import SendTimeout, drop_connection, send_within
from cadenza.gateway.state import GatewayState, PreparedResponse, RequestError, new_id

log = logging.getLogger(__name__)
Refusal = tuple[str, str]  # (code, message)


@dataclass(eq=False)
class Job:
    create: p.ResponseCreate
    response_id: str | None = None  # known once the response starts
    task: asyncio.Task[None] | None = None
    steer_input: list[dict[str, str]] | None = None  # set by response.steer
    held: bool = True  # holds an admission place and a `pending` count until released (once)
    finishing: bool = False  # past its stream: cancel and steer no longer interrupt its events


@dataclass(eq=False)
class Lane:
    stream_id: str | None
    jobs: deque[Job] = field(default_factory=deque)
    runner: asyncio.Task[None] | None = None  # lives while the lane has work, then retires it


class ResponsesSocket:
    direct = True  # sends its runs' events itself (response_run.Transport)

    def __init__(self, ws: WebSocket, state: GatewayState) -> None:
        self.ws = ws
        self.state = state
        self.client = state.admission.client(ws.client and ws.client.host)
        self.lanes: dict[str | None, Lane] = {}
        self.active: dict[str, Job] = {}  # response id -> running job
        self.job_tasks: dict[asyncio.Task[None], Job] = {}  # started jobs, from their first moment
        self.pending = 0  # responses admitted on this socket and not yet finished
        self.seq = 0
        self.send_lock = asyncio.Lock()
        self.closed = False  # nothing more is sent, and nothing new is queued
        self.stalled = False  # a send timed out: the client stopped reading
        self.serve_task: asyncio.Task[None] | None = None

    @property
    def headers(self) -> Any:
        return self.ws.headers

    async def send(self, event: p.Json, stream_id: str | None = None) -> None:
        if self.closed:
            return
        async with self.send_lock:
            if self.closed:  # closed while this send waited for the lock
                return
            event = {**event, "sequence_number": self.seq}
            if stream_id is not None:
                event["stream_id"] = stream_id
            self.seq += 1
            try:
                await send_within(self.ws.send_text(p.encode(event).decode()), self.state.settings.send_timeout_s)
            except SendTimeout:
                self.stall()
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True

    def stall(self) -> None:
        """A client that stopped reading: end the socket, which cancels its responses and
        frees their places (more sends would only queue behind the one that timed out), and
        drop its connection, whose unsent bytes would otherwise hold it open."""
        log.warning("websocket client %s stopped reading for send_timeout_s; ending its socket", self.client)
        self.closed = self.stalled = True
        if self.serve_task is not None:
            self.serve_task.cancel()
        drop_connection(self.ws.scope)

    async def serve(self) -> None:
        self.serve_task = asyncio.current_task()
        try:
            await self.read_frames()
        except asyncio.CancelledError:
            if not self.stalled:  # only the stall's own cancel ends the socket quietly
                raise
        finally:
            self.closed = True
            await self.stop_all()

    async def read_frames(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is None:  # never parsed: events are JSON text
                error = "binary frames are not supported: send events as JSON text frames"
                await self.send(p.error_event(error, "binary_frame_not_supported"))
                continue
            await self.on_frame(message["text"].encode())  # limits count UTF-8 bytes, not characters

    async def on_frame(self, frame: bytes) -> None:
        if self.closed:  # the client is gone or stalled: nothing could be answered
            return
        limit = self.state.settings.max_frame_bytes
        if len(frame) > limit:
            message = f"message of {len(frame)} bytes exceeds {limit} (max_frame_bytes)"
            await self.send(p.error_event(message, "frame_too_large"))
            return
        try:
            check_json(frame, self.state.settings.max_json_depth)
        except ValueError as e:
            code = "json_too_deep" if isinstance(e, JsonDepthError) else "invalid_event"
            await self.send(p.error_event(str(e), code))
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
        """Admission happens here, before the job's task renders or tokenizes anything."""
        refusal = self.refusal(create)
        if refusal is None and not self.state.admission.try_acquire(self.client):
            code, message = self.state.admission.refusal(self.client)
            retry = {"retry_after_ms": RETRY_AFTER_MS, "headers": {"retry-after-ms": str(RETRY_AFTER_MS)}}
            refusal = p.error_event(message, code, 429, **retry)
        if refusal is not None:
            await self.send(refusal, create.stream_id)
            return
        self.pending += 1
        self.enqueue(Job(create))

    def refusal(self, create: p.ResponseCreate) -> p.Json | None:
        """The socket's own limits, each named in its message (cheap checks, before admission)."""
        s, sid = self.state.settings, create.stream_id
        if sid is not None and len(sid) > s.max_stream_id_chars:
            message = f"stream_id is longer than {s.max_stream_id_chars} characters (max_stream_id_chars)"
            return p.error_event(message, "stream_id_too_long", 400, "stream_id")
        if p.input_count(create.input) > s.max_messages:
            message = f"input has more than {s.max_messages} messages (max_messages)"
            return p.error_event(message, "too_many_messages", 400, "input")
        if self.pending >= s.max_responses_per_socket:
            message = f"this socket already has {self.pending} responses in flight (max_responses_per_socket)"
            return p.error_event(message, "too_many_responses", 429)
        if sid not in self.lanes and len(self.lanes) >= s.max_lanes_per_socket:
            message = f"this socket already has {len(self.lanes)} busy lanes (max_lanes_per_socket)"
            return p.error_event(message, "too_many_lanes", 429, "stream_id")
        return None

    def enqueue(self, job: Job, front: bool = False) -> None:
        if self.closed:  # stop_all has run or is running: nothing may wait behind it
            self.release(job)
            return
        lane = self.lanes.get(job.create.stream_id) or self.open_lane(job.create.stream_id)
        (lane.jobs.appendleft if front else lane.jobs.append)(job)

    def open_lane(self, stream_id: str | None) -> Lane:
        lane = self.lanes[stream_id] = Lane(stream_id)
        lane.runner = asyncio.get_running_loop().create_task(self.run_lane(lane))
        lane.runner.add_done_callback(lambda _: self.retire(lane))  # also when cancelled before it ran
        return lane

    async def run_lane(self, lane: Lane) -> None:
        """Runs the lane's jobs in order, and retires the lane the moment it has none left (in
        the same step, so a create for this stream_id either joins it or opens a new one)."""
        try:
            while lane.jobs:
                job = lane.jobs.popleft()
                job.task = asyncio.get_running_loop().create_task(self.run_job(job))
                self.job_tasks[job.task] = job
                job.task.add_done_callback(lambda task, job=job: self.job_done(job, task))
                await asyncio.wait((job.task,))  # unlike awaiting it, a cancelled job does not end the lane
        finally:
            self.retire(lane)

    def job_done(self, job: Job, task: asyncio.Task[None]) -> None:
        """Runs however the task ended, even if it was cancelled before its first step."""
        self.job_tasks.pop(task, None)
        self.release(job)
        if not task.cancelled() and task.exception() is not None:  # run_job catches; this is a bug
            log.error("a response task failed", exc_info=task.exception())

    def retire(self, lane: Lane) -> None:
        if self.lanes.get(lane.stream_id) is lane:
            del self.lanes[lane.stream_id]
        while lane.jobs:  # queued behind a cancelled runner: they will never run
            self.release(lane.jobs.popleft())

    def release(self, job: Job) -> None:
        if job.held:
            job.held = False
            self.pending -= 1
            self.state.admission.release(self.client)

    async def on_steer(self, steer: p.ResponseSteer) -> None:
        job = self.active.get(steer.previous_response_id)
        info = {"previous_response_id": steer.previous_response_id}
        messages, error = self.steer_messages(steer, job)
        if error is not None or job is None:
            code, message = error or ("response_not_active", "that response is not running here")
            await self.send(
                {
                    "type": "response.steer.failed",
                    "error": {"type": "invalid_request_error", "code": code, "message": message},
                    "steer": {**info, "input": p.encode(steer.input).decode()},
                }
            )
            return
        job.steer_input = (job.steer_input or []) + messages  # set before any await: run_job reads it
        await self.send({"type": "response.steer.accepted", "steer": {"id": new_id("steer"), **info}})
        if job.task is not None and not job.finishing:  # a finishing one completes; its successor follows
            job.task.cancel()

    def steer_messages(self, steer: p.ResponseSteer, job: Job | None) -> tuple[list[dict[str, str]], Refusal | None]:
        """The steer's input as messages, or ([], (code, message)) saying why it cannot be used."""
        limit, held = self.state.settings.max_messages, len(job.steer_input or []) if job else 0
        if p.input_count(steer.input) + held > limit:
            return [], ("too_many_messages", f"steer input has more than {limit} messages (max_messages)")
        try:
            messages = p.input_messages(steer.input)
        except ValueError as e:
            return [], ("invalid_input", str(e))
        return messages, (None if messages else ("invalid_input", "steer input is empty"))

    async def on_cancel(self, cancel: p.ResponseCancel) -> None:
        job = self.active.get(cancel.response_id)
        if job is None or job.task is None:
            message = f"response {cancel.response_id!r} is not running on this socket"
            await self.send(p.error_event(message, "response_not_found", 404, "response_id"))
            return
        if not job.finishing:  # past its stream, cancelling would only cut off its terminal event
            job.task.cancel()

    async def stop_all(self) -> None:
        """Ends every response; `closed` is set first, so nothing can be queued while this waits
        (a steered response's successor included) and every place comes back."""
        self.closed = True
        tasks = [lane.runner for lane in self.lanes.values() if lane.runner]
        # Including jobs created but not yet started; a background response runs on (its
        # events are kept for a resume) and gives its place back when it ends.
        tasks += [task for task, job in self.job_tasks.items() if not job.create.background]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for lane in list(self.lanes.values()):  # lanes whose runner was cancelled before it ran
            self.retire(lane)

    async def run_job(self, job: Job) -> None:
        """One response. Whatever fails ends it with an event (`error` before response.created,
        `response.failed` after) and the lane goes on; the place is released by job_done."""
        create, sid = job.create, job.create.stream_id
        grammar = GrammarPlace()
        try:
            prepared = await self.state.prepare(create, headers=self.headers)
            grammar = await self.state.grammars.admit(self.client, prepared.params)  # in a thread, in budget
            run = ResponseRun(self, job, prepared)
        except Exception as e:
            grammar.release()
            await self.send(_prepare_error(e), sid)
            return
        job.response_id = prepared.response_id
        self.active[prepared.response_id] = job
        try:
            await run.run()
        finally:
            self.active.pop(prepared.response_id, None)
            grammar.release()
        if job.steer_input is not None and not self.closed:  # closed: stop_all ran or is running
            self.continue_steered(job, prepared)

    def continue_steered(self, job: Job, prepared: PreparedResponse) -> None:
        """The successor continues from the steered response at the front of its lane, taking a
        place unconditionally (its parent's is released a moment later, when its task ends)."""
        messages = [p.InputMessage(role=m["role"], content=m["content"]) for m in job.steer_input]
        successor = msgspec.structs.replace(job.create, input=messages, previous_response_id=prepared.response_id)
        self.state.admission.acquire(self.client)
        self.pending += 1
        self.enqueue(Job(successor), front=True)


def _prepare_error(e: Exception) -> p.Json:
    """The `error` event for a response that failed before it started. A ValueError from the
    chat template or the tokenizer (a template's raise_exception on roles that do not
    alternate) is about the client's input; anything else is ours, logged, not shown."""
    if isinstance(e, RequestError):
        return p.error_event(str(e), e.code, e.status, e.param)
    if isinstance(e, ValueError):
        return p.error_event(str(e), "invalid_input", 400, "input")
    log.error("preparing a response failed", exc_info=e)
    return p.error_event("the server failed to prepare this response", "server_error", 500)
