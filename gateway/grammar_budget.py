"""GrammarBudget: what a request's grammar may cost the server, settled after admission.

Decoding a body only makes a StructuredOutputs (its shape checked, nothing compiled). Once the
request holds an admission place, `admit` counts it against the grammar quota (sequences
following a grammar, server-wide and per client: each costs the engine's one mask thread
every step), then compiles its grammar in a worker thread of its own, never on the event
loop, within max_grammar_bytes and grammar_compile_timeout_s. Verdicts are cached by the
grammar's content hash (cadenza.structured_outputs), so a repeated grammar is compiled once
per process; one that ran out of time is refused at once when it comes again. llguidance's
own budgets (lexer fuel, grammar symbols) bound the work a thread cannot be stopped from.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cadenza.gateway.request_error import RequestError
from cadenza.gateway.settings import GatewaySettings
from cadenza.sampling_params import SamplingParams
from cadenza.structured_outputs import StructuredOutputs

# Compiles at once: two keep one slow grammar from queueing every other behind it, without
# taking the cores the tokenizer threads and the engine need.
COMPILE_THREADS = 2
# Grammars remembered as too slow to compile.
SLOW_CACHE_SIZE = 256


class GrammarPlace:
    """A request's places in the grammar quota, given back once, however it ends."""

    def __init__(self, budget: GrammarBudget | None = None, client: str = "", count: int = 0) -> None:
        self._budget, self._client, self._count = budget, client, count

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.release(self._client, self._count)


class GrammarBudget:
    def __init__(self, settings: GatewaySettings) -> None:
        self.max_bytes = settings.max_grammar_bytes
        self.timeout_s = settings.grammar_compile_timeout_s
        self.max_requests = settings.max_grammar_requests
        self.max_per_client = settings.max_grammar_requests_per_client
        self.in_flight = 0
        self.clients: Counter[str] = Counter()
        self._slow: OrderedDict[str, str] = OrderedDict()  # digest -> the refusal
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")

    async def admit(self, client: str, params: SamplingParams) -> GrammarPlace:
        """The request's places (none without a grammar) once its grammar compiles; else a
        RequestError: 429 past the quota, 400 for a grammar too large, too slow or invalid."""
        spec = params.structured_outputs
        if spec is None:
            return GrammarPlace()
        place = self.acquire(client, params.n)
        try:
            await self.compile(spec)
        except BaseException:
            place.release()
            raise
        return place

    def acquire(self, client: str, count: int) -> GrammarPlace:
        if self.in_flight + count > self.max_requests:
            message = (
                f"the server already runs {self.in_flight} sequences with a grammar; this request's {count} "
                f"would pass {self.max_requests} (max_grammar_requests); retry shortly"
            )
            raise RequestError(message, "too_many_grammar_requests", None, 429)
        if self.clients[client] + count > self.max_per_client:
            message = (
                f"this client already runs {self.clients[client]} sequences with a grammar; this request's "
                f"{count} would pass {self.max_per_client} (max_grammar_requests_per_client)"
            )
            raise RequestError(message, "too_many_grammar_requests", None, 429)
        self.in_flight += count
        self.clients[client] += count
        return GrammarPlace(self, client, count)

    def release(self, client: str, count: int) -> None:
        self.in_flight -= count
        self.clients[client] -= count
        assert self.in_flight >= 0 and self.clients[client] >= 0, f"{client} released more grammar places than it held"
        if not self.clients[client]:
            del self.clients[client]

    async def compile(self, spec: StructuredOutputs) -> None:
        """Returns once the grammar is known valid. The time budget runs from the compile's
        start: a grammar queued behind others is not judged slow (it may wait as long again
        for a thread, then is a 429), only one that ran out of time is remembered."""
        digest = spec.digest()  # ~1 ms for a 256 KiB schema
        param = _param(spec)
        if digest in self._slow:
            raise RequestError(self._slow[digest], "grammar_too_complex", param)
        loop, started = asyncio.get_running_loop(), asyncio.Event()
        work = self._pool.submit(self._judge, spec, lambda: loop.call_soon_threadsafe(started.set))
        try:
            await asyncio.wait_for(started.wait(), self.timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself only from 3.11
            work.cancel()
            message = "every grammar compiler thread is busy; retry shortly"
            raise RequestError(message, "too_many_grammar_requests", param, 429) from None
        try:
            await asyncio.wait_for(asyncio.wrap_future(work), self.timeout_s)
        except asyncio.TimeoutError:
            message = (
                f"{spec.source}: the {spec.kind} took longer than {self.timeout_s} s to compile "
                "(grammar_compile_timeout_s); simplify it"
            )
            self._remember_slow(digest, message)
            raise RequestError(message, "grammar_too_complex", param) from None

    def _judge(self, spec: StructuredOutputs, on_start: Callable[[], object]) -> None:
        """In a compile thread: the size cap, then the (cached) compile."""
        on_start()
        param = _param(spec)
        try:
            size = len(spec.llguidance_grammar().encode())
        except (ValueError, TypeError):
            size = 0  # not a grammar at all: check() says why
        if size > self.max_bytes:
            message = f"{spec.source}: the {spec.kind} is {size} bytes compiled; at most {self.max_bytes}"
            raise RequestError(message + " (max_grammar_bytes)", "grammar_too_large", param)
        try:
            spec.check()
        except ValueError as e:
            raise RequestError(str(e), "invalid_request", param) from None

    def _remember_slow(self, digest: str, message: str) -> None:
        self._slow[digest] = message
        while len(self._slow) > SLOW_CACHE_SIZE:
            self._slow.popitem(last=False)

    def check_invariants(self) -> None:
        """For the tests."""
        assert self.in_flight == sum(self.clients.values()) >= 0, (self.in_flight, self.clients)


def _param(spec: StructuredOutputs) -> str:
    """The request field a refusal names (`response_format.json_schema` -> `response_format`)."""
    return spec.source.split(".")[0]
