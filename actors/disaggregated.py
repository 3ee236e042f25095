"""Prefill/decode disaggregation: N prefill engines and M decode engines (each an AsyncLLM: its
own engine actor and workers) served as one EngineClient.

A request is prefilled on the least-loaded prefill engine, which samples its first token (the
client gets it at once); the prefill engine's cached blocks of the prompt go to a decode engine
through the KV connector (actors/kv_connector/: the hash chain, bytes in Ray's object store,
blocks the decode engine already caches skipped) while the prompt is prefilled: after each
prefill step the blocks it cached move, so a prompt of many chunks waits after its first token
only for its last chunk's blocks. The request then resumes on the decode engine after
its first token (EngineRequest.output_token_ids: max_tokens, penalties and seeded draws carry
on as if it had never moved), computing only the prompt's last partial block and that token.
A handoff that fails is a recompute on the decode engine, for that request alone, and so is a
prefill engine that dies under a request: the decode engine computes the prompt and goes on
after whatever tokens were already streamed (none lost, none repeated). A decode engine that
dies fails its requests with its error (AsyncLLM restarts it, max_engine_restarts); the other
engines go on. The decode
engine is the one already holding the conversation (session affinity), else the one holding
most of the prompt's leading blocks (prefix affinity, weighed against load), else the least
loaded.
A prompt of at most max_local_prefill_tokens is prefilled on its decode engine instead: a chat
turn's prefill costs that engine about a step, where a prefill engine would queue it behind
long prompts and then hand it over.
Speculation runs on the decode engines only; with a draft model the prefill engines run the
draft over the prompt as well (never proposing), because its KV shares the blocks and moves
with them. Requests that would gain nothing (n > 1, prompt logprobs, a one-token answer) run
whole on a decode engine.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from cadenza.actors.async_llm import AsyncLLM
from cadenza.actors.kv_connector.engine_port import prefix_hashes
from cadenza.actors.kv_connector.handoff import move_blocks
from cadenza.actors.prompts import tokenize
from cadenza.config import DEFAULT_MODEL
from cadenza.engine_client import Prompt
from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.outputs import RequestOutput
from cadenza.sampling_params import SamplingParams
from cadenza.speculative_config import SpeculativeConfig
from cadenza.stats import KVTransferStats, ServingStats

log = logging.getLogger(__name__)
# Sessions whose decode engine is remembered (least recently used forgotten first).
MAX_SESSIONS = 65536
# Block hashes remembered per decode engine for prefix affinity (least recently sent forgotten).
MAX_HASHES_PER_ENGINE = 1 << 17
# Prefix affinity yields to load: an engine holding the prefix is chosen unless it runs more
# than this many requests beyond the least loaded.
AFFINITY_SLACK = 4
# The longest one export waits on the prefill engine for a prompt's next cached block. The
# prefill's last step ends the wait of a prompt whose blocks all get cached; this bounds only
# a run that cannot grow (its blocks evicted there): then the rest is recomputed.
KV_STREAM_WAIT_S = 1.0


class HashIndex:
    """The block hashes sent to one engine, bounded, least recently used forgotten: an
    estimate of its prefix cache (the engine may have evicted some; then it recomputes)."""

    def __init__(self, limit: int = MAX_HASHES_PER_ENGINE) -> None:
        self.limit, self.hashes = limit, OrderedDict[bytes, None]()

    def run(self, hashes: list[bytes]) -> int:
        """How many of the chain's leading blocks it holds."""
        count = 0
        for h in hashes:
            if h not in self.hashes:
                break
            count += 1
        return count

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.limit:
            self.hashes.popitem(last=False)


def parse_disaggregation(spec: str) -> tuple[int, int]:
    """ "1P1D" -> (1, 1): prefill and decode engine counts."""
    match = re.fullmatch(r"(\d+)P(\d+)D", spec.strip().upper())
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"disaggregation must look like 1P1D or 2P3D (engines of each role, >= 1), got {spec!r}")
    return int(match[1]), int(match[2])


def _engine_lost(error: BaseException, engine: AsyncLLM) -> bool:
    """Whether a leg failed because its engine died (not because of the request itself)."""
    return isinstance(error, EngineDeadError) or engine.dead or "engine actor died" in str(error)


class DisaggregatedLLM:
    """disaggregation: "NPMD". Engine arguments are AsyncLLM's, for every engine (the same
    model, block size, TP and PP on both sides, so blocks and shards match);
    speculative_config applies to the decode engines (a draft model is loaded on the prefill
    engines too, for its KV). Prefix caching is on (the hand-over
    is a prefix-cache import)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        disaggregation: str = "1P1D",
        dtype: str = "auto",
        seed: int = 0,
        ray_address: str | None = None,
        **engine_args: Any,
    ) -> None:
        num_prefill, num_decode = parse_disaggregation(disaggregation)
        if engine_args.get("enable_prefix_caching") is False:
            raise ValueError("disaggregation hands KV over through the prefix cache: leave prefix caching on")
        spec = SpeculativeConfig.parse(engine_args.get("speculative_config"))
        if engine_args.get("kv_transport", "auto") == "auto":  # engines on one node share their caches
            engine_args = {**engine_args, "kv_transport": "ipc"}
        # A draft model's KV lives in the same blocks as the model's and moves with them, so
        # prefill engines run the draft over the prompt too (the prefill leg asks for no drafts).
        drafts = spec is not None and spec.method == "draft_model"
        prefill_args = {k: v for k, v in engine_args.items() if drafts or k != "speculative_config"}
        self.prefill = [AsyncLLM(model, dtype, seed, ray_address, **prefill_args) for _ in range(num_prefill)]
        self.decode = [AsyncLLM(model, dtype, seed, ray_address, **engine_args) for _ in range(num_decode)]
        first = self.decode[0]
        self.config, self.tokenizer, self.max_model_len = first.config, first.tokenizer, first.max_model_len
        self.request_limits, self.sampling_defaults = first.request_limits, first.sampling_defaults
        self.ray_instance = first.ray_instance
        self.transfer = KVTransferStats()
        self._load: dict[int, int] = {}  # id(engine) -> legs in flight
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> decode engine index
        self._legs: dict[str, list[tuple[AsyncLLM, str]]] = {}  # request id -> its legs
        # What each decode engine was last sent (block hashes): where a prompt's prefix likely is.
        self._held = [HashIndex() for _ in self.decode]
        self._turn = 0
        self._ids = 0

    @property
    def speculative(self) -> bool:
        return self.decode[0].speculative

    def get_tokenizer(self) -> Any:  # noqa: ANN401 - the engines' Tokenizer
        return self.decode[0].get_tokenizer()

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        pace: bool = False,
        cache_salt: str | None = None,
        session_id: str | None = None,
        resume_from: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """resume_from: outputs produced elsewhere (a re-issued response): the decode engine
        computes prompt and outputs and goes on after them."""
        params = sampling_params or SamplingParams()
        mover: asyncio.Task[BaseException | None] | None = None
        text, ids = tokenize(self.tokenizer, prompt)
        self._ids += 1
        rid = request_id if request_id is not None else f"pd-{self._ids}"
        tokens = {"prompt_token_ids": ids, "prompt": text}
        hashes = prefix_hashes(ids, self.config.block_size, cache_salt)
        decode = self._decode_for(session_id, hashes)
        whole = params.n != 1 or params.prompt_logprobs is not None or params.max_tokens == 1
        local = len(ids) <= self.config.max_local_prefill_tokens  # short: prefilled where it decodes
        self._legs[rid] = []
        try:
            if resume_from or (local and not whole):  # the decode engine computes the prompt
                legs = (decode, rid, tokens, params, priority, pace, cache_salt, session_id, list(resume_from or []))
                async for out in self._decode(*legs):
                    yield out
                return
            if whole:
                async for out in self._leg(decode, rid, "#d", tokens, params, priority, pace, cache_salt, session_id):
                    yield out
                return
            first: list[int] = []
            handoff: tuple[float, float] | None = None
            prefill, prefilled = self._prefill_engine(), asyncio.Event()
            try:
                if prefill.dead:  # every prefill engine is gone: the decode engine computes it all
                    raise EngineDeadError("no prefill engine is serving")
                move = self._move_prompt(prefill, ids, cache_salt, len(hashes), decode, prefilled)
                mover = asyncio.create_task(move)
                # Sent before the request, its first export normally reaches the prefill engine
                # first (Ray does not promise an async actor's order; with no argument pending it
                # keeps it): it waits there and takes the first step's blocks.
                await asyncio.sleep(0)
                async for out in self._prefill(prefill, rid, tokens, params, priority, cache_salt, first):
                    yield out
                    if out.finished:
                        return
                handoff = await self._hand_over(mover, prefilled)
            except (EngineDeadError, RequestFailedError) as e:  # the prefill engine died under it
                if mover is not None:
                    mover.cancel()  # what it moved stays usable; the decode engine computes the rest
                self.transfer.num_prefill_failures += 1
                log.warning("prefill engine lost (%s); the decode engine computes the prompt", e)
            async for out in self._decode(decode, rid, tokens, params, priority, pace, cache_salt, session_id, first):
                if handoff is not None and out.metrics:  # the gateway's trace gets a kv_handoff span
                    out.metrics[0].kv_handoff, handoff = handoff, None
                yield out
        finally:
            self._legs.pop(rid, None)
            if mover is not None:
                mover.cancel()  # done, or the prefill failed or the client left: nothing to wait for

    def _prefill_engine(self) -> AsyncLLM:
        """The least-loaded prefill engine that is not known dead."""
        alive = [e for e in self.prefill if not e.dead] or self.prefill
        return min(alive, key=lambda e: self._load.get(id(e), 0))

    async def _prefill(
        self, engine: AsyncLLM, rid: str, tokens: dict, params: SamplingParams, priority: int,
        cache_salt: str | None, first: list[int],
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """The first token, sampled on the prefill engine (the least loaded); its artificial
        length stop is not the request's."""
        one = msgspec.structs.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), num_speculative_tokens=0
        )
        async for out in self._leg(engine, rid, "#p", tokens, one, priority, False, cache_salt, None):
            completion = out.outputs[0]
            first += completion.token_ids
            if out.finished and completion.finish_reason == "length":
                completion.finish_reason, out.finished = None, False
            yield out

    async def _decode(
        self, engine: AsyncLLM, rid: str, tokens: dict, params: SamplingParams, priority: int, pace: bool,
        cache_salt: str | None, session_id: str | None, emitted: list[int],
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """The rest of the request on a decode engine; if that engine dies under it, on another
        live one, resumed after every token already streamed (it recomputes the prompt)."""
        emitted = list(emitted)
        while True:
            try:
                leg = self._leg(engine, rid, "#d", tokens, params, priority, pace, cache_salt, session_id, emitted)
                async for out in leg:
                    emitted += out.outputs[0].token_ids
                    yield out
                return
            except (EngineDeadError, RequestFailedError) as e:
                others = [d for d in self.decode if d is not engine and not d.dead]
                if not others or not _engine_lost(e, engine):
                    raise
                self.transfer.num_decode_resumes += 1
                log.warning("decode engine lost (%s); resuming after %d tokens elsewhere", e, len(emitted))
                engine = min(others, key=lambda d: self._load.get(id(d), 0))
                if session_id is not None:
                    self._sessions[session_id] = self.decode.index(engine)
                hashes = prefix_hashes(tokens["prompt_token_ids"], self.config.block_size, cache_salt)
                self._held[self.decode.index(engine)].add(hashes)

    async def _move_prompt(
        self, prefill: AsyncLLM, ids: list[int], cache_salt: str | None, total: int, decode: AsyncLLM,
        prefilled: asyncio.Event,
    ) -> BaseException | None:  # fmt: skip
        """The prompt's full blocks from the prefill engine to `decode`, in parts: each export
        waits for a prefill step to cache more, so a prompt of many chunks moves while its later
        chunks compute; once the first token has come (`prefilled`), one last part without a
        wait, until all `total` full blocks have gone. Returns what failed, if anything: the
        decode engine recomputes what did not come."""
        sent = 0
        try:
            places = await decode.kv_places()  # known: no call. A prefill engine there too leases the blocks
            while sent < total:
                last = prefilled.is_set()
                export = prefill.export_kv(ids, cache_salt, sent, 0.0 if last else KV_STREAM_WAIT_S, places)
                moved = await move_blocks(export, decode.import_kv, self.transfer, prefill.release_kv)
                sent += moved
                if sent < total:
                    self.transfer.num_blocks_streamed += moved
                if last:
                    break
        except Exception as e:  # returned: the caller counts it and goes on
            return e
        return None

    async def _hand_over(
        self, mover: asyncio.Task[BaseException | None], prefilled: asyncio.Event
    ) -> tuple[float, float]:
        """Wait for the prompt's last blocks (the first token has come); a failure leaves the
        decode engine to recompute them. Returns the wall-clock window of the wait."""
        start, wall = time.monotonic(), time.time()
        prefilled.set()
        if (e := await mover) is None:
            self.transfer.num_handoffs += 1
        else:
            self.transfer.num_fallbacks += 1
            log.warning("KV hand-over failed, recomputing on the decode engine: %s: %s", type(e).__name__, e)
        self.transfer.seconds += time.monotonic() - start
        return wall, time.time()

    async def _leg(
        self, engine: AsyncLLM, rid: str, suffix: str, tokens: dict, params: SamplingParams, priority: int,
        pace: bool, cache_salt: str | None, session_id: str | None, resume_from: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """One engine's part of a request, its outputs under the request's own id."""
        leg_id = rid + suffix
        self._legs[rid].append((engine, leg_id))
        self._load[id(engine)] = self._load.get(id(engine), 0) + 1
        try:
            stream = engine.generate(tokens, params, leg_id, priority, pace, cache_salt, session_id, resume_from)
            async for out in stream:
                out.request_id = rid
                yield out
        finally:
            self._load[id(engine)] -= 1

    def _decode_for(self, session_id: str | None, hashes: list[bytes]) -> AsyncLLM:
        """The session's decode engine (its KV is there); else the live engine holding the
        longest run of the prompt's blocks, unless it is busier than the least loaded by more
        than AFFINITY_SLACK requests; else the least loaded (ties taken in turn)."""
        if session_id is not None and (index := self._sessions.get(session_id)) is not None:
            if not self.decode[index].dead:
                self._sessions.move_to_end(session_id)
                return self.decode[index]
        live = [i for i, d in enumerate(self.decode) if not d.dead] or list(range(len(self.decode)))
        load = {i: self._load.get(id(self.decode[i]), 0) for i in live}
        least = min(load.values())
        self._turn += 1
        idle = [i for i in live if load[i] == least]
        index = idle[self._turn % len(idle)]
        held = {i: self._held[i].run(hashes) for i in live}
        best = max(live, key=lambda i: (held[i], -load[i]))
        if held[best] and load[best] <= least + AFFINITY_SLACK:
            index = best
        if session_id is not None:
            self._sessions[session_id] = index
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self._held[index].add(hashes)
        return self.decode[index]

    def engine_of(self, request_id: str) -> AsyncLLM | None:
        """The engine running the request's current leg (for operators and fault tests)."""
        legs = self._legs.get(request_id)
        return legs[-1][0] if legs else None

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(engine.abort(leg) for engine, leg in self._legs.get(request_id, [])))

    async def stats(self) -> ServingStats:
        """The first live decode engine's, with every live engine's requests counted, the
        hand-overs (`kv_transfer`) and each live engine's own stats by role (`roles`)."""
        roles = [("prefill", e) for e in self.prefill] + [("decode", e) for e in self.decode]
        answers = await asyncio.gather(*(e.stats() for _, e in roles), return_exceptions=True)
        live = [(role, a) for (role, _), a in zip(roles, answers, strict=True) if isinstance(a, ServingStats)]
        decode = [a for role, a in live if role == "decode"]
        if not decode:
            raise EngineDeadError("no decode engine is serving")
        merged = msgspec.structs.replace(decode[0], engine=msgspec.structs.replace(decode[0].engine))
        merged.engine.num_running = sum(a.engine.num_running for _, a in live)
        merged.engine.num_waiting = sum(a.engine.num_waiting for _, a in live)
        merged.kv_transfer = msgspec.structs.replace(self.transfer)
        merged.roles = live
        return merged

    async def check_health(self) -> None:
        """Serving while a decode engine is: without prefill engines the decode engines compute
        prompts themselves (slower, still correct)."""
        problems = await asyncio.gather(*(e.check_health() for e in self.decode), return_exceptions=True)
        if all(isinstance(p, BaseException) for p in problems):
            raise EngineDeadError(f"no decode engine can serve: {problems[0]}")

    def shutdown(self) -> None:
        for engine in (*self.prefill, *self.decode):
            engine.shutdown()
