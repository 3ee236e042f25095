"""A bounded loopback soak of `cadenza serve` (its own server, SmolLM2): HTTP and websocket
clients run a fixed plan of requests with cancels, disconnects and bad inputs mixed in, and
one worker is SIGKILLed part-way. Every completed greedy reply must equal the engine's
reference text, every request must end (a reply, a refusal, or a failure naming the dead
worker), and nothing may be held at the end: no admission slot, no running request, no KV
block. Prints one JSON document (tests/.artifacts/soak.json too)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest
import websockets
from cadenza_testkit.servers import API_KEY, ARTIFACTS, launch_server

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is two plus two?",
    "Say hello in Spanish.",
]
MAX_TOKENS = 16
NUM_BLOCKS = 1024
HTTP_CLIENTS, WS_CLIENTS, ROUNDS = 4, 4, 6
# Each client's plan repeats this cycle (offset per client): mostly real replies, then one
# cancel, one disconnect and one bad input in every cycle.
CYCLE = ["greedy", "greedy", "cancel", "greedy", "bad", "disconnect"]
KILL_AFTER = 12  # requests finished before the worker is killed
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
HANG_GUARD_S = 600  # the whole soak; a guard against a hang, not a speed check


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    mismatches: list[tuple[str, str, str]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    finished: int = 0
    finished_event: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome == "failed_as_expected":  # which way: a refused bad input, or the killed worker
            self.outcomes["killed_worker" if "worker" in detail else "bad_input_refused"] += 1
        if outcome == "failed_unexpectedly":
            self.unexpected.append(detail)
        self.finished += 1
        if self.finished >= KILL_AFTER:
            self.finished_event.set()

    def check_reply(self, question: str, text: str, expected: dict[str, str]) -> None:
        if text == expected[question]:
            self.record("done")
        else:
            self.mismatches.append((question, text, expected[question]))
            self.record("failed_unexpectedly", f"reply to {question!r} differs")

    def failed(self, message: str) -> None:
        # A request running when the worker was killed fails with the reason; nothing else may.
        expected = "worker" in message and ("died" in message or "failed" in message)
        self.record("failed_as_expected" if expected else "failed_unexpectedly", message)  # names the worker


def _body(question: str, stream: bool, **extra: object) -> dict:
    messages = [{"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream, **extra}


async def _http_request(session: aiohttp.ClientSession, url: str, kind: str, question: str, tally: Tally) -> None:
    if kind == "bad":  # a top_k past 64 bits: refused, never a worker failure
        async with session.post(url, json=_body(question, False, top_k=2**63), headers=AUTH) as r:
            await r.read()
            tally.record("failed_as_expected" if r.status == 400 else "failed_unexpectedly", f"bad -> {r.status}")
        return
    stream = kind != "greedy" or hash(question) % 2 == 0
    sent = time.monotonic()
    async with session.post(url, json=_body(question, stream), headers=AUTH) as r:
        if r.status == 500 and not stream:  # a whole answer whose request the dead worker took
            tally.failed((await r.json())["error"]["message"])
            return
        if r.status != 200:
            tally.record("failed_unexpectedly", f"HTTP {r.status}: {await r.text()}")
            return
        if not stream:
            body = await r.json()
            tally.ttfts.append(time.monotonic() - sent)
            tally.check_reply(question, body["choices"][0]["message"]["content"], EXPECTED)
            return
        await _read_sse(r, kind, question, sent, tally)


async def _read_sse(r: aiohttp.ClientResponse, kind: str, question: str, sent: float, tally: Tally) -> None:
    text, first = "", None
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            tally.failed(chunk["error"]["message"])
            return
        delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if delta:
            first = first or time.monotonic()
            text += delta
            if kind != "greedy":  # cancel or disconnect: leave mid-stream (closing aborts it)
                tally.record("done")
                return
    if first is not None:
        tally.ttfts.append(first - sent)
    tally.check_reply(question, text, EXPECTED) if kind == "greedy" else tally.record("done")


async def http_client(index: int, base: str, tally: Tally) -> None:
    async with aiohttp.ClientSession() as session:
        for r in range(ROUNDS):
            kind, question = CYCLE[(index + r) % len(CYCLE)], QUESTIONS[(index + r) % len(QUESTIONS)]
            await _http_request(session, base + "/v1/chat/completions", kind, question, tally)


async def _ws_response(conn: websockets.ClientConnection, kind: str, question: str, tally: Tally) -> bool:
    """One response on an open socket; False when the socket was closed on purpose."""
    create = {"type": "response.create", "model": MODEL, "input": question, "temperature": 0}
    create["max_output_tokens"] = MAX_TOKENS
    if kind == "bad":
        create["temperature"] = 7.5  # out of range: an `error` event, the socket stays open
    sent, text, first, response_id = time.monotonic(), "", None, None
    await conn.send(json.dumps(create))
    async for frame in conn:
        event = json.loads(frame)
        kind_of = event["type"]
        if kind_of == "error" and event["error"]["code"] == "response_not_found":
            continue  # our cancel arrived after that response had ended: nothing to cancel
        if kind_of == "error":
            ok = kind == "bad" and event["status"] == 400
            tally.record("failed_as_expected" if ok else "failed_unexpectedly", json.dumps(event["error"]))
            return True
        if kind_of == "response.output_text.delta":
            first = first or time.monotonic()
            text += event["delta"]
            if kind == "cancel" and event["delta"]:
                await conn.send(json.dumps({"type": "response.cancel", "response_id": response_id}))
                kind = "cancelled"
            elif kind == "disconnect":
                await conn.close()
                tally.record("done")
                return False
        elif kind_of == "response.created":
            response_id = event["response"]["id"]
        elif kind_of in TERMINAL:
            return _ws_terminal(event, kind, question, text, sent, first, tally)
    tally.record("failed_unexpectedly", "the socket closed before a terminal event")
    return False


def _ws_terminal(event: dict, kind: str, question: str, text: str, sent: float, first, tally: Tally) -> bool:  # noqa: ANN001
    if event["type"] == "response.failed":
        tally.failed(event["response"]["error"]["message"])
    elif kind == "greedy":
        if first is not None:
            tally.ttfts.append(first - sent)
        tally.check_reply(question, text, EXPECTED)
    else:
        tally.record("done")
    return True


async def ws_client(index: int, url: str, tally: Tally) -> None:
    conn = await websockets.connect(url, additional_headers=AUTH)
    try:
        for r in range(ROUNDS):
            kind, question = CYCLE[(index + r + 3) % len(CYCLE)], QUESTIONS[(index + r) % len(QUESTIONS)]
            if not await _ws_response(conn, kind, question, tally):
                conn = await websockets.connect(url, additional_headers=AUTH)
    finally:
        await conn.close()


async def killer(server, tally: Tally) -> None:  # noqa: ANN001
    await tally.finished_event.wait()
    pid = server.get("/stats")["engine"]["worker_pids"][0]
    os.kill(pid, signal.SIGKILL)


EXPECTED: dict[str, str] = {}


@pytest.mark.slow
def test_soak_with_cancels_disconnects_bad_inputs_and_a_killed_worker(ray_cluster, smollm) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = smollm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    EXPECTED.update({q: o.outputs[0].text for q, o in zip(QUESTIONS, outs, strict=True)})
    # Worker actors (not the default in-process runner), so there is a worker to kill and rebuild.
    args = ["--num-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens", "512", "--api-key", API_KEY]
    args += ["--executor", "ray"]

    async def soak(server) -> Tally:  # noqa: ANN001
        tally = Tally()
        clients = [http_client(i, server.http, tally) for i in range(HTTP_CLIENTS)]
        clients += [ws_client(i, server.ws, tally) for i in range(WS_CLIENTS)]
        kill = asyncio.ensure_future(killer(server, tally))
        await asyncio.wait_for(asyncio.gather(*clients), HANG_GUARD_S)
        await kill
        return tally

    with launch_server(args, "soak.log") as server:
        start = time.monotonic()
        tally = asyncio.run(soak(server))
        elapsed = time.monotonic() - start
        stats = server.settled_stats()
    engine = stats["engine"]
    ttfts = sorted(tally.ttfts)
    report = {
        "requests": tally.finished,
        "done": tally.outcomes["done"],
        "failed_as_expected": tally.outcomes["failed_as_expected"],
        "failed_unexpectedly": tally.outcomes["failed_unexpectedly"],
        "of_which_bad_input_refused": tally.outcomes["bad_input_refused"],
        "of_which_running_when_the_worker_died": tally.outcomes["killed_worker"],
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3) if ttfts else None,
        "elapsed_s": round(elapsed, 1),
        "worker_restarts": engine["num_worker_restarts"],
        "in_flight_at_end": stats["gateway"]["in_flight"],
        "free_blocks_at_end": engine["engine"]["kv_cache"]["num_free_blocks"],
        "pinned_blocks_at_end": engine["engine"]["num_pinned_blocks"],  # conversations' prefixes, held by design
    }
    print(json.dumps(report))
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "soak.json").write_text(json.dumps(report, indent=2))
    assert report["requests"] == (HTTP_CLIENTS + WS_CLIENTS) * ROUNDS
    assert not tally.mismatches, tally.mismatches
    assert not tally.unexpected, tally.unexpected
    assert report["worker_restarts"] == 1
    assert report["in_flight_at_end"] == 0
    assert report["free_blocks_at_end"] + report["pinned_blocks_at_end"] == NUM_BLOCKS  # nothing leaked
    assert engine["engine"]["num_running"] == engine["engine"]["num_waiting"] == 0
