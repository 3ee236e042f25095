"""The shared response log (gateway/shared_log.py) without Ray: LogBoard's rules (leases,
fencing, resent flushes, cancels routed to the owner, adoption), and two gateways over one board
with real tiny engines: a response read and cancelled through the other replica, and a response
whose replica dies re-issued on the survivor, its resumed events equal to the uncut reference.
Serve's own run of this (a replica SIGKILLed) is in tests/deploy/test_serve_deploy.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from cadenza_testkit.waiting import until

from cadenza.gateway.app import build_app
from cadenza.gateway.log_messages import FlushReply, LogSlice, LogUpdate, ReissueSpec
from cadenza.gateway.mirrored_logs import MirroredLogs
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.shared_log import LogBoard

BOUNDS = GatewaySettings().response_log_bounds
SPEC = ReissueSpec(b"{}", None, 0, 0.0)


def _update(rid: str, first: int, events: list[str], epoch: int = 0, done: bool = False, **more: Any) -> LogUpdate:
    kept = [("response.output_text.delta", json.dumps({"i": first + i, "d": e}).encode()) for i, e in enumerate(events)]
    fields = {"response": None, "first_delta": 0, "deltas": [], "overflowed": False, "spec": None, **more}
    return LogUpdate(rid, epoch, first, kept, first + len(events), done=done, **fields)


def test_board_leases_fencing_resends_cancels_and_adoption() -> None:
    asyncio.run(_board_rules())


async def _board_rules() -> None:
    board = LogBoard(BOUNDS, owner_timeout_s=5.0)
    reply = board.flush("A", [_update("r1", 0, ["a", "b"], spec=SPEC, deltas=[b"d0"])], now=0.0)
    assert reply == FlushReply([], [], [])
    board.flush("A", [_update("r1", 0, ["a", "b", "c"], first_delta=0, deltas=[b"d0"])], now=1.0)  # a resend
    got = await board.read("r1", None, -1, 0.0)
    assert [json.loads(d)["d"] for _, d in got.events] == ["a", "b", "c"] and not got.done
    assert await board.read("r1", "another tenant", -1, 0.0) is None
    assert board.flush("B", [_update("r1", 3, ["x"])], now=1.0).fenced == ["r1"]  # not B's
    assert board.cancel("r1", None) and not board.cancel("r1", "another tenant")
    assert board.flush("B", [], now=2.0).cancels == []  # told to its owner only
    assert board.flush("A", [], now=2.0).cancels == ["r1"]
    assert board.flush("A", [], now=2.5).cancels == []  # once
    # A falls silent: past its lease, the next replica to flush adopts its unfinished response.
    assert board.flush("B", [], now=6.0).adopted == []
    (adoption,) = board.flush("B", [], now=7.6).adopted
    assert (adoption.epoch, adoption.count, adoption.deltas, len(adoption.events)) == (1, 3, [b"d0"], 3)
    assert board.flush("A", [_update("r1", 3, ["late"])], now=7.7).fenced == ["r1"]  # A came back: fenced
    board.flush("B", [_update("r1", 3, ["d"], epoch=1, done=True)], now=8.0)
    got = await board.read("r1", None, 2, 0.0)
    assert [json.loads(d)["d"] for _, d in got.events] == ["d"] and got.done
    # A replica that leaves (Serve stops it) hands its responses over at once.
    board.flush("C", [_update("r2", 0, ["a"], spec=SPEC)], now=8.0)
    board.leave("C")
    assert [a.response_id for a in board.flush("B", [], now=8.5).adopted] == ["r2"]
    # A log that restarted empty asks for what it does not know, whole; the epoch is kept.
    fresh = LogBoard(BOUNDS, owner_timeout_s=5.0)
    assert fresh.flush("B", [_update("r1", 4, ["e"], epoch=1)], now=0.0).lost == ["r1"]
    whole = _update("r1", 0, ["a", "b", "c", "d", "e"], epoch=1, spec=SPEC)
    assert fresh.flush("B", [whole], now=0.1) == FlushReply([], [], [], [])
    assert (await fresh.read("r1", None, -1, 0.0)).kept == 5


class BoardClient:
    """SharedLogClient's surface over a LogBoard in this process; every message goes through
    msgpack as it would cross to the actor."""

    def __init__(self, board: LogBoard) -> None:
        self.board = board

    async def flush(self, owner: str, updates: list[LogUpdate]) -> FlushReply:
        sent = msgspec.msgpack.decode(msgspec.msgpack.encode(updates), type=list[LogUpdate])
        reply = self.board.flush(owner, sent)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=FlushReply)

    async def read(self, response_id: str, tenant: str | None, after: int, wait_s: float) -> LogSlice | None:
        return await self.board.read(response_id, tenant, after, min(wait_s, 0.2))

    def cancel_soon(self, response_id: str, tenant: str | None) -> None:
        self.board.cancel(response_id, tenant)


class SlowEngine:
    """An engine whose deltas come no faster than one per `pace_s`: a run still going when its
    replica is stopped."""

    def __init__(self, engine: Any, pace_s: float) -> None:  # noqa: ANN401
        self.engine, self.pace_s = engine, pace_s

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self.engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for delta in self.engine.generate(*args, **kwargs):
            await asyncio.sleep(self.pace_s)
            yield delta


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


def test_two_replicas_over_one_shared_log(tiny_chat_model: Path) -> None:
    """Two gateways, each with its own engine, over one board (on one loop, as in one test)."""
    from cadenza.actors.inprocess_client import InProcessClient

    async def run() -> None:
        engines = [InProcessClient(str(tiny_chat_model), num_blocks=128) for _ in range(2)]
        try:
            await _re_issue(engines)
            await _cancel_elsewhere(engines)
            await _cancel_while_orphaned(engines)
            await _log_restarts(engines)
            await _log_down(engines[0])
        finally:
            for engine in engines:
                engine.shutdown()

    asyncio.run(run())


def _replica(engine: Any, board: LogBoard, name: str) -> tuple[httpx.AsyncClient, MirroredLogs]:  # noqa: ANN401
    logs = MirroredLogs(BOUNDS, BoardClient(board), name, flush_s=0.05)  # type: ignore[arg-type]
    logs.start()
    app = build_app(engine, "tiny", GatewaySettings(), logs=logs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"), logs


BODY = {"model": "tiny", "input": "tell me a story", "max_output_tokens": 40, "temperature": 0}


async def _events(client: httpx.AsyncClient, rid: str, after: int) -> list[dict]:
    r = await client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": str(after)})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def _text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def _re_issue(engines: list) -> None:
    """A's response, A dead mid-way: B re-issues it, and a client resuming through B sees the
    uncut reference's events, none missing or repeated."""
    board = LogBoard(BOUNDS, owner_timeout_s=0.5)
    a, a_logs = _replica(SlowEngine(engines[0], 0.03), board, "A")
    b, b_logs = _replica(engines[1], board, "B")
    reference = (await b.post("/v1/responses", json=BODY)).json()
    uncut = reference["output"][0]["content"][0]["text"]
    assert reference["usage"]["output_tokens"] == 40
    rid = (await a.post("/v1/responses", json={**BODY, "background": True})).json()["id"]
    # B answers for A's response while it runs: it reads the shared log.
    assert (await b.get(f"/v1/responses/{rid}")).json()["status"] == "in_progress"
    await until(lambda: len(board.entries.get(rid).events) >= 8, "a few of A's tokens in the shared log")
    a_logs._task.cancel()  # A dies: it writes no more, and its lease runs out
    seen = await _events(b, rid, -1)  # what a client of A had seen, as far as the shared log holds it
    cut = len(seen) - 1
    assert cut >= 7 and seen[-1]["type"] != "response.completed"
    rest = await _events(b, rid, cut)  # B re-issues it; the resumed stream picks up after `cut`
    events = seen + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # no gap, no repeat
    assert events[-1]["type"] == "response.incomplete" and _text(events) == uncut
    final = (await b.get(f"/v1/responses/{rid}")).json()
    assert final["output"][0]["content"][0]["text"] == uncut and final["usage"]["output_tokens"] == 40
    assert b_logs.reissued == 1 and board.reissued == 1
    await a.aclose()
    await b.aclose()


async def _cancel_elsewhere(engines: list) -> None:
    board = LogBoard(BOUNDS, owner_timeout_s=5.0)
    a, _ = _replica(SlowEngine(engines[0], 0.05), board, "A")
    b, _ = _replica(engines[1], board, "B")
    rid = (await a.post("/v1/responses", json={**BODY, "background": True})).json()["id"]
    cancelled = (await b.post(f"/v1/responses/{rid}/cancel")).json()
    assert cancelled["status"] == "cancelled" and cancelled["usage"]["output_tokens"] < 40
    assert (await a.get(f"/v1/responses/{rid}")).json()["status"] == "cancelled"
    assert (await b.get("/v1/responses/resp_unknown")).status_code == 404
    await a.aclose()
    await b.aclose()


async def _cancel_while_orphaned(engines: list) -> None:
    """A cancel sent while the response's replica is dead reaches its re-issue, after the replay."""
    board = LogBoard(BOUNDS, owner_timeout_s=0.3)
    a, a_logs = _replica(SlowEngine(engines[0], 0.03), board, "A")
    b, _ = _replica(SlowEngine(engines[1], 0.03), board, "B")
    rid = (await a.post("/v1/responses", json={**BODY, "background": True})).json()["id"]
    await until(lambda: len(board.entries.get(rid).events) >= 6, "a few of A's tokens in the shared log")
    a_logs._task.cancel()
    cancelled = (await b.post(f"/v1/responses/{rid}/cancel")).json()
    assert cancelled["status"] == "cancelled" and cancelled["usage"]["output_tokens"] < 40
    events = await _events(b, rid, -1)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"
    await a.aclose()
    await b.aclose()


async def _log_restarts(engines: list) -> None:
    """The shared log restarts empty mid-response: its owner sends the response again, whole,
    and every replica reads it complete."""
    board = LogBoard(BOUNDS, owner_timeout_s=5.0)
    a, a_logs = _replica(SlowEngine(engines[0], 0.02), board, "A")
    b, b_logs = _replica(engines[1], board, "B")
    rid = (await a.post("/v1/responses", json={**BODY, "background": True})).json()["id"]
    await until(lambda: len(board.entries.get(rid).events) >= 6, "some events in the first log")
    fresh = LogBoard(BOUNDS, owner_timeout_s=5.0)
    a_logs.client.board = b_logs.client.board = fresh  # type: ignore[attr-defined]
    # Unknown there until its owner's next flush (at most response_log_flush_s later).
    await until(lambda: fresh.entries.get(rid) is not None, "the response sent again to the new log")
    events = await _events(b, rid, -1)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 40
    await a.aclose()
    await b.aclose()


class DownClient(BoardClient):
    async def flush(self, owner: str, updates: list[LogUpdate]) -> FlushReply:
        raise ConnectionError("the shared log is unreachable")


async def _log_down(engine: Any) -> None:  # noqa: ANN401
    """With the shared log unreachable, responses go on as on one gateway: answered, readable
    here, never left waiting for an acknowledgement that will not come."""
    logs = MirroredLogs(BOUNDS, DownClient(LogBoard(BOUNDS, 5.0)), "A", flush_s=0.05)  # type: ignore[arg-type]
    app = build_app(engine, "tiny", GatewaySettings(), logs=logs)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1")
    whole = (await client.post("/v1/responses", json=BODY)).json()
    assert whole["status"] == "incomplete" and whole["usage"]["output_tokens"] == 40
    events = await _events(client, whole["id"], -1)
    assert events[-1]["type"] == "response.incomplete" and logs.mirrors == {}
    await client.aclose()
