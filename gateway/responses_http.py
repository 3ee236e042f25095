"""The Responses API over HTTP: `POST /v1/responses` (whole, or SSE with the websocket's
events), `GET /v1/responses/{id}` (the response, or with `stream=true&starting_after=N` its
events after N and then the live ones), `POST /v1/responses/{id}/cancel`.

A response runs as its own task, writing its events to the response log
(response_events.py) that every reader follows. A foreground stream's response is cancelled
when its client goes away; a `background: true` one runs on until it ends or is cancelled,
and any client may resume it from the last sequence number it saw.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cadenza.gateway import protocol as p
from cadenza.gateway.admission import RETRY_AFTER_MS
from cadenza.gateway.http_guard import BodyError, error_response, read_json
from cadenza.gateway.request_error import RequestError
from cadenza.gateway.response_events import ReplayError, ResponseEvents
from cadenza.gateway.response_run import ResponseRun
from cadenza.gateway.responses_ws import Job
from cadenza.gateway.state import GatewayState


class _LogOnly:
    """The run's transport over HTTP: nothing is sent directly, readers follow the log."""

    def __init__(self, state: GatewayState, headers: Any) -> None:
        self.state, self.headers = state, headers

    async def send(self, event: p.Json, stream_id: str | None = None) -> None:
        return None


class ResponsesHttp:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.tasks: set[asyncio.Task[None]] = set()  # runs, held so none is collected mid-way

    async def create(self, request: Request) -> Response:
        try:
            create = await read_json(request, p.ResponseCreate, self.state.settings)
        except BodyError as e:
            return error_response(e.status, str(e), e.code)
        admission = self.state.admission
        client = admission.client(request.client and request.client.host)
        if not admission.try_acquire(client):
            code, message = admission.refusal(client)
            return error_response(429, message, code, **{"Retry-After": str(max(1, RETRY_AFTER_MS // 1000))})
        try:
            prepared = await self.state.prepare(create, headers=request.headers)
        except Exception as e:
            admission.release(client)
            return _refusal(e)
        job = Job(create, prepared.response_id)
        run = ResponseRun(_LogOnly(self.state, request.headers), job, prepared)
        job.task = asyncio.get_running_loop().create_task(run.run())
        self.tasks.add(job.task)
        job.task.add_done_callback(lambda t: (self.tasks.discard(t), admission.release(client)))
        return await self._answer(create, run.log, job.task)

    async def _answer(self, create: p.ResponseCreate, log: ResponseEvents, task: asyncio.Task[None]) -> Response:
        if create.stream:
            on_close = None if create.background else task.cancel  # a foreground reader owns its run
            return FollowingStream(_sse(log, -1), on_close)
        if create.background:  # answered at once: the response as created, then poll or resume
            await log.wait_for(1)
            return JSONResponse(log.response)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the client went away: so does its foreground response
            task.cancel()
            raise
        return JSONResponse(log.response)

    async def retrieve(self, request: Request) -> Response:
        log = self._log(request)
        if log is None:
            return _not_found(request)
        if request.query_params.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(log.response)
        try:
            after = int(request.query_params.get("starting_after", "-1"))
        except ValueError:
            return error_response(400, "starting_after must be an integer", "invalid_request", "starting_after")
        if after != -1 and not 0 <= after < len(log.events):
            message = f"starting_after {after} is not among this response's {len(log.events)} kept events"
            return error_response(400, message, "invalid_request", "starting_after")
        return FollowingStream(_sse(log, after), None)

    async def cancel(self, request: Request) -> Response:
        log = self._log(request)
        if log is None:
            return _not_found(request)
        log.cancel()
        await log.wait_done()  # its terminal event carries the cancelled response
        return JSONResponse(log.response)

    def _log(self, request: Request) -> ResponseEvents | None:
        return self.state.logs.get(request.path_params["response_id"])


async def _sse(log: ResponseEvents, after: int) -> AsyncIterator[str]:
    try:
        async for event in log.follow(after):
            yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
    except ReplayError as e:
        error = p.error_event(str(e), "replay_unavailable", 410)
        yield f"event: error\ndata: {json.dumps(error)}\n\n"


class FollowingStream(StreamingResponse):
    """SSE of a response's events; on_close runs however the stream ends (a client gone
    before the first event included), so a foreground run never outlives its reader."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any] | None) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def _not_found(request: Request) -> Response:
    message = f"response {request.path_params['response_id']!r} not found (events are kept for response_log_ttl_s)"
    return error_response(404, message, "response_not_found", "response_id")


def _refusal(e: Exception) -> Response:
    if isinstance(e, RequestError):
        status = 404 if e.code in ("model_not_found", "previous_response_not_found") else 400
        return error_response(status, str(e), e.code, e.param)
    return error_response(400, f"the request could not be prepared: {e}", "invalid_request")
