"""The Responses API over HTTP: `POST /v1/responses` (whole, or SSE with the websocket's
events), `GET /v1/responses/{id}` (the response, or with `stream=true&starting_after=N` its
events after N and then the live ones), `POST /v1/responses/{id}/cancel`.

A response runs as its own task, writing its events to the response log
(response_events.py) that every reader follows. A foreground stream's response is cancelled
when its client goes away; a `background: true` one runs on until it ends or is cancelled,
and its tenant may resume it from the last sequence number it saw. A response is its tenant's
(the key that created it, and the create's `cache_salt`, which GET and cancel send as the
`cache_salt` query parameter); to any other caller it is not found (404), as an unknown id.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cadenza.gateway import protocol as p
from cadenza.gateway.admission import RETRY_AFTER
from cadenza.gateway.http_guard import BodyError, error_response, read_json
from cadenza.gateway.log_messages import Adoption
from cadenza.gateway.request_error import RequestError
from cadenza.gateway.response_events import ReplayError, ResponseEvents
from cadenza.gateway.response_run import ResponseRun
from cadenza.gateway.responses_ws import Job
from cadenza.gateway.send_deadline import SseStream
from cadenza.gateway.state import GatewayState, tenant_salt
from cadenza.request_limits import presented_key

if TYPE_CHECKING:  # Ray's side of the shared log, under Serve only
    from cadenza.gateway.mirrored_logs import MirroredLogs, RemoteLog


class _LogOnly:
    """The run's transport over HTTP: nothing is sent directly, readers follow the log."""

    direct = False  # readers follow the log

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
        limit = self.state.settings.max_messages
        if p.input_count(create.input) > limit:  # as on the websocket, before admission
            message = f"input has more than {limit} messages (max_messages)"
            return error_response(400, message, "too_many_messages", "input")
        admission = self.state.admission
        client = admission.client(request.client and request.client.host)
        refused = admission.admit(client, create.stream)
        if refused is not None:
            return _too_many(refused)
        prepared = None
        try:
            ready = await self.state.prepare(create, headers=request.headers)
            grammar = await self.state.grammars.admit(client, ready.params)  # in a thread, in budget
            prepared = ready
        except Exception as e:
            return _refusal(e)
        finally:  # a failure, or a cancel: under Serve a client that leaves cancels this task, here
            if prepared is None:
                admission.give_back(client, create.stream)
        job = Job(create, prepared.response_id)
        run = ResponseRun(_LogOnly(self.state, request.headers), job, prepared)
        job.task = asyncio.get_running_loop().create_task(run.run())
        self.tasks.add(job.task)
        job.task.add_done_callback(lambda t: (self.tasks.discard(t), admission.release(client), grammar.release()))
        return await self._answer(create, run.log, job.task, client)

    async def _answer(
        self, create: p.ResponseCreate, log: ResponseEvents, task: asyncio.Task[None], client: str
    ) -> Response:
        if create.stream:  # a foreground reader owns its run
            return self._stream(log, -1, client, None if create.background else task)
        if create.background:  # answered at once: the response as created, then poll or resume
            await log.wait_for(1)
            await log.wait_durable(1)  # under Serve: any replica finds it once its id is known
            return JSONResponse(log.response)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the client went away: so does its foreground response
            task.cancel()
            raise
        await log.wait_durable(log.count)
        return JSONResponse(log.response)

    def adopt(self, adoption: Adoption) -> None:
        """Re-issues here a response whose replica died (shared_log.py): no admission, it was
        admitted where it started, and its clients are already waiting for it."""
        task = asyncio.get_running_loop().create_task(self._reissue(adoption))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reissue(self, adoption: Adoption) -> None:
        spec = adoption.spec
        create = msgspec.json.decode(spec.create, type=p.ResponseCreate)
        job = Job(create, adoption.response_id)
        try:
            prepared = await self.state.prepare_as(create, spec.tenant, spec.priority, adoption.response_id)
        except Exception as e:  # its conversation's stored turns are gone: it fails, visibly
            log = cast("MirroredLogs", self.state.logs).restore(adoption)
            model = self.state.model_name
            failed = p.response_object(adoption.response_id, model, "failed", create, [], spec.created_at)
            message = f"the response's replica died and it could not be re-issued: {e}"
            error = {"code": "server_error", "message": message}
            log.append({"type": "response.failed", "response": {**failed, "error": error}})
            log.finish()
            return
        run = ResponseRun(_LogOnly(self.state, {}), job, prepared, adoption)
        job.task = asyncio.current_task()
        if cast("MirroredLogs", self.state.logs).take_cancel(adoption.response_id):
            run.cancel()  # after its replay: a client cancelled it while its replica was dead
        await run.run()

    async def retrieve(self, request: Request) -> Response:
        log = await self._find(request)
        if log is None:
            return _not_found(request)
        if request.query_params.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(log.response)
        try:
            after = int(request.query_params.get("starting_after", "-1"))
        except ValueError:
            return error_response(400, "starting_after must be an integer", "invalid_request", "starting_after")
        if after != -1 and not 0 <= after < log.kept:
            message = f"starting_after {after} is not among this response's {log.kept} kept events"
            return error_response(400, message, "invalid_request", "starting_after")
        client = self.state.admission.client(request.client and request.client.host)
        if not self.state.admission.open_stream(client):
            return _too_many(self.state.admission.stream_refusal(client))
        return self._stream(log, after, client, None)

    async def cancel(self, request: Request) -> Response:
        log = await self._find(request)
        if log is None:
            return _not_found(request)
        log.cancel()
        await log.wait_done()  # its terminal event carries the cancelled response
        return JSONResponse(log.response)

    def _stream(
        self, log: ResponseEvents | RemoteLog, after: int, client: str, run: asyncio.Task[None] | None
    ) -> SseStream:
        """SSE of a response's events after `after`, holding one of `client`'s streams (opened
        by the caller) until it ends however it ends; `run`: a foreground response's task,
        which never outlives its reader."""

        def close() -> None:
            if run is not None:
                run.cancel()
            self.state.admission.close_stream(client)

        settings = self.state.settings
        return SseStream(_sse(log, after), settings.send_timeout_s, close, keep_alive_s=settings.sse_keep_alive_s)

    async def _find(self, request: Request) -> ResponseEvents | RemoteLog | None:
        """The response's log if it is the caller's tenant's (its key, and the `cache_salt` query
        parameter its create carried): another tenant's is not found, as an unknown id. Under
        Serve, a response another replica runs (or ran) is read from the shared log."""
        tenant = tenant_salt(presented_key(request.headers), request.query_params.get("cache_salt"))
        response_id = request.path_params["response_id"]
        logs = self.state.logs
        found = logs.get(response_id, tenant)
        if (found is None or found.moved) and logs.shared:
            return await cast("MirroredLogs", logs).fetch(response_id, tenant)
        return found


async def _sse(log: ResponseEvents | RemoteLog, after: int) -> AsyncGenerator[bytes | str, None]:
    try:
        async for kind, data in log.follow(after):  # kept as JSON: sent as it is
            yield b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
    except ReplayError as e:
        error = p.error_event(str(e), "replay_unavailable", 410)
        yield f"event: error\ndata: {json.dumps(error)}\n\n"


def _too_many(refused: tuple[str, str]) -> Response:
    code, message = refused
    return error_response(429, message, code, **RETRY_AFTER)


def _not_found(request: Request) -> Response:
    message = f"response {request.path_params['response_id']!r} not found (events are kept for response_log_ttl_s)"
    return error_response(404, message, "response_not_found", "response_id")


def _refusal(e: Exception) -> Response:
    if isinstance(e, RequestError):
        status = 404 if e.code in ("model_not_found", "previous_response_not_found") else e.status
        retry = RETRY_AFTER if status == 429 else {}
        return error_response(status, str(e), e.code, e.param, **retry)
    return error_response(400, f"the request could not be prepared: {e}", "invalid_request")
