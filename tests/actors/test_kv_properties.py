"""Property tests of the block pool, the KV cache manager and the scheduler (issue #14).

Random sequences of add / schedule / update / abort / preempt / worker reset, run against a
fake runner that keeps its own copy of every request (as the real one does, from the deltas
alone) and a model of each block's KV contents. After every step the pool's reference counts,
free queue and prefix index must agree with the live block tables, no step may write a block
another request holds, every position a request attends to must hold KV of its own prefix,
and in the end every request finishes or is aborted: nothing waits forever.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cadenza.actors.block_pool import BlockPool
from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.request import Request, RequestStatus
from cadenza.actors.scheduler import Scheduler
from cadenza.messages import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput
from cadenza.sampling_params import SamplingParams

pytestmark = pytest.mark.heavy  # not in make test-quick: hypothesis state machines over the scheduler

EOS = 0
VOCAB = 5  # small, so sampled continuations repeat and later prompts hit the prefix cache
ALPHABET = st.integers(1, 3)  # prompt tokens; EOS stays out of prompts
MAX_MODEL_LEN = 96
MAX_DRAIN_STEPS = 10_000
FINISH_REASONS = {"stop", "length", "abort", "error"}


@dataclass
class RunnerCopy:
    """What a runner knows of one request, built from NewRequestData and CachedRequestData only."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


def prefix_keys(tokens: list[int]) -> list[int]:
    """keys[p] identifies the KV at position p: it depends on the whole prefix tokens[: p + 1]."""
    keys, key = [], 0
    for token in tokens:
        key = hash((key, token))
        keys.append(key)
    return keys


class SchedulerMachine(RuleBasedStateMachine):
    """One engine (scheduler, cache manager, pool) and the fake runner that executes its plans."""

    @initialize(
        num_blocks=st.integers(8, 40),
        block_size=st.sampled_from([4, 2]),
        prefix_caching=st.booleans(),
        # Mostly a small budget so prompts are chunked; sometimes one larger than the whole
        # pool, the only way a prompt's first chunk can fail to fit an empty pool.
        budget=st.one_of(st.integers(1, 24), st.just(256)),
        max_num_seqs=st.integers(1, 6),
        priorities=st.booleans(),
        stems=st.lists(st.lists(ALPHABET, max_size=20), min_size=1, max_size=3),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool,
        budget: int,
        max_num_seqs: int,
        priorities: bool,
        stems: list[list[int]],
        seed: int,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, block_size, prefix_caching)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, MAX_MODEL_LEN)
        self.bs = block_size
        self.priorities = priorities
        self.stems = stems  # shared prompt heads, so prefixes repeat across requests
        self.rng = random.Random(seed)  # the fake runner's samples
        self.arrivals = 0
        self.params: dict[str, SamplingParams] = {}
        self.prompt_len: dict[str, int] = {}
        self.salt: dict[str, str | None] = {}
        self.oversized: set[str] = set()  # requests that cannot fit even an empty pool
        self.expect_error: set[str] = set()  # requests the test itself made fail
        self.leader_of: dict[str, str] = {}
        self.streamed: dict[str, list[int]] = {}
        self.ended: dict[str, str] = {}
        self.in_flight: SchedulerOutput | None = None
        self.runner: dict[str, RunnerCopy] = {}
        self.content: dict[int, dict[int, int]] = defaultdict(dict)  # block id -> slot -> prefix key

    # ---- adding work -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return min(MAX_MODEL_LEN, self.pool.num_blocks * self.bs)

    def _prompt(self, stem: int, cut: int, tail: list[int]) -> list[int]:
        head = self.stems[stem % len(self.stems)]
        return (head[: cut % (len(head) + 1)] + tail) or [1]

    def _add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        leader: str | None = None,
        salt: str | None = None,
    ) -> None:
        self.arrivals += 1
        req = EngineRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            priority=priority if self.priorities else 0,
            cache_salt=salt,
            prefix_leader=leader,
        )
        self.sched.add_request(Request(req, (EOS,), self.arrivals))
        self.params[rid] = params
        self.salt[rid] = salt
        self.prompt_len[rid] = len(prompt)
        self.streamed[rid] = []
        if leader is not None:
            self.leader_of[rid] = leader

    def _fitting(
        self, prompt: list[int], max_tokens: int, ignore_eos: bool, prompt_logprobs: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """Trim to what EngineCore admits (prompt + max_tokens within the context and the pool):
        the scheduler finishes such requests only; with the prefix cache off, one that outgrows
        the pool alone preempts itself forever."""
        prompt = prompt[: self.capacity - 1]
        max_tokens = min(max_tokens, self.capacity - len(prompt))
        logprobs = 1 if prompt_logprobs else None
        return prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, prompt_logprobs=logprobs)

    @rule(
        stem=st.integers(0, 2),
        cut=st.integers(0, 20),
        tail=st.lists(ALPHABET, max_size=12),
        max_tokens=st.integers(1, 16),
        ignore_eos=st.booleans(),
        priority=st.integers(0, 2),
        salt=st.sampled_from([None, "tenant-2"]),
        prompt_logprobs=st.booleans(),
    )
    def add_request(
        self,
        stem: int,
        cut: int,
        tail: list[int],
        max_tokens: int,
        ignore_eos: bool,
        priority: int,
        salt: str | None,
        prompt_logprobs: bool,
    ) -> None:
        prompt, params = self._fitting(self._prompt(stem, cut, tail), max_tokens, ignore_eos, prompt_logprobs)
        self._add(f"r{self.arrivals}", prompt, params, priority, salt=salt)

    @rule(
        stem=st.integers(0, 2),
        cut=st.integers(0, 20),
        tail=st.lists(ALPHABET, max_size=12),
        max_tokens=st.integers(1, 16),
        n=st.integers(2, 3),
        priority=st.integers(0, 2),
        salt=st.sampled_from([None, "tenant-2"]),
    )
    def add_family(
        self, stem: int, cut: int, tail: list[int], max_tokens: int, n: int, priority: int, salt: str | None
    ) -> None:
        """n > 1 as cadenza.actors.prompts.fan_out makes it: child 0 leads, the others follow it."""
        prompt, params = self._fitting(self._prompt(stem, cut, tail), max_tokens, ignore_eos=False)
        base = f"r{self.arrivals}"
        for i in range(n):
            self._add(f"{base}-{i}", prompt, params, priority, f"{base}-0" if i else None, salt)

    @precondition(lambda self: self.sched.max_num_batched_tokens > self.pool.num_blocks * self.bs)
    @rule(extra=st.integers(1, 40), priority=st.integers(0, 2))
    def add_oversized(self, extra: int, priority: int) -> None:
        """A prompt whose first chunk alone needs more blocks than the pool has."""
        pool_tokens = self.pool.num_blocks * self.bs
        length = min(pool_tokens + extra, self.sched.max_num_batched_tokens)
        rid = f"r{self.arrivals}"
        self._add(rid, [1 + i % 3 for i in range(length)], SamplingParams(max_tokens=4), priority)
        self.oversized.add(rid)

    # ---- stepping ----------------------------------------------------------------------

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def schedule(self) -> None:
        so = self.sched.schedule()
        self._record(self.sched.take_failed())
        self._apply_to_runner(so)
        self._check_plan(so)
        self.in_flight = so

    @precondition(lambda self: self.in_flight is not None)
    @rule(fail=st.integers(0, 4))
    def update(self, fail: int) -> None:
        self._finish_step(fail_one=fail == 4)  # now and then one request's sampling breaks

    @precondition(lambda self: self.in_flight is None)
    @rule(steps=st.integers(1, 6))
    def step(self, steps: int) -> None:
        """Whole steps, several at a time: requests need many of them to run to the end."""
        for _ in range(steps):
            self.schedule()
            self._finish_step(False)
            self.check_all()

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def step_raises(self) -> None:
        """The runner raised: EngineCore.fail_step fails the step's requests alone."""
        so, self.in_flight = self.in_flight, None
        ids = [rid for rid in so.num_scheduled_tokens if rid in self.sched.requests]
        self.expect_error |= set(ids)
        self._record(self.sched.fail(list(so.num_scheduled_tokens), "the step raised"))

    def _finish_step(self, fail_one: bool) -> None:
        so, self.in_flight = self.in_flight, None
        out = self._execute(so)
        if fail_one and out.sampled:
            rid = self.rng.choice(sorted(out.sampled))
            del out.sampled[rid]
            out.failed[rid] = "sampling failed"
            self.expect_error.add(rid)
        self._record(self.sched.update(so, out))

    # ---- interference ------------------------------------------------------------------

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Any id: live, finished, or never seen (the engine must shrug the last two off)."""
        ids = sorted(self.params) + ["nobody"]
        rid = data.draw(st.sampled_from(ids))
        outs = self.sched.abort([rid])
        assert [o.request_id for o in outs] == ([rid] if rid not in self.ended and rid != "nobody" else [])
        self._record(outs)

    @precondition(lambda self: self.in_flight is None and self.sched.running)
    @rule()
    def preempt(self) -> None:
        """Preempt the tail as the scheduler does when the pool runs dry."""
        self.sched._preempt(self.sched.running.pop())
        event("forced preemption")

    @rule()
    def worker_reset(self) -> None:
        """The workers died (possibly mid-step): their KV is gone and the plan in flight with it."""
        running = {r.request_id for r in self.sched.running}
        outs = self.sched.reset_after_worker_loss("workers lost")
        assert {o.request_id for o in outs} == running
        assert all(o.finish_reason == "error" and o.error for o in outs)
        self.expect_error |= running
        self._record(outs)
        self.in_flight = None
        self.runner.clear()
        self.content.clear()  # rebuilt workers start from fresh memory
        assert not self.pool.cached and all(b.block_hash is None for b in self.pool.blocks)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert not self.sched.finished_ids
        assert all(r.num_computed_tokens == 0 for r in self.sched.waiting)

    # ---- the fake runner ---------------------------------------------------------------

    def _apply_to_runner(self, so: SchedulerOutput) -> None:
        """ModelRunner._update_states, order included: drop, add, then extend."""
        for rid in so.finished_req_ids:
            self.runner.pop(rid, None)
        for new in so.new_requests:
            assert new.req_id not in self.runner, f"{new.req_id} sent as new while the runner holds it"
            self.runner[new.req_id] = RunnerCopy(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for delta in so.cached_requests:
            assert delta.req_id in self.runner, f"delta for {delta.req_id}, unknown to the runner"
            copy = self.runner[delta.req_id]
            copy.block_ids += delta.new_block_ids
            copy.token_ids += delta.new_token_ids
            copy.num_computed_tokens = delta.num_computed_tokens
        # Every running request is on the runner, and nothing else is.
        assert set(self.runner) == {r.request_id for r in self.sched.running}

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Write each scheduled position's KV, check every attended position holds KV of the
        request's own prefix, and sample once a request has computed all its known tokens."""
        out = ModelRunnerOutput.empty()
        for rid, n in so.num_scheduled_tokens.items():
            copy = self.runner[rid]
            keys = prefix_keys(copy.token_ids)
            start, end = copy.num_computed_tokens, copy.num_computed_tokens + n
            for p in range(start, end):
                self.content[copy.block_ids[p // self.bs]][p % self.bs] = keys[p]
            for p in range(end):
                bid = copy.block_ids[p // self.bs]
                assert self.content[bid].get(p % self.bs) == keys[p], f"{rid}: wrong KV at position {p}, block {bid}"
            copy.num_computed_tokens = end
            if end >= len(copy.token_ids):
                out.sampled[rid] = [self.rng.randrange(VOCAB)]
        return out

    def _check_plan(self, so: SchedulerOutput) -> None:
        s = self.sched
        new_ids = [n.req_id for n in so.new_requests]
        cached_ids = [c.req_id for c in so.cached_requests]
        assert len(set(new_ids + cached_ids)) == len(new_ids) + len(cached_ids)
        assert set(so.num_scheduled_tokens) == set(new_ids) | set(cached_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= s.max_num_batched_tokens
        for rid, n in so.num_scheduled_tokens.items():
            self._check_scheduled(rid, n)
        for new in so.new_requests:
            self._check_admitted(new.req_id, new.num_computed_tokens)
        if s.num_preemptions:
            event("preempted")
        if self.pool.hits:
            event("prefix-cache hit")

    def _check_scheduled(self, rid: str, n: int) -> None:
        req, copy = self.sched.requests[rid], self.runner[rid]
        assert req.status == RequestStatus.RUNNING and n >= 1
        assert copy.token_ids == req.all_token_ids, f"{rid}: runner's tokens drifted from the scheduler's"
        assert copy.block_ids == self.kv.block_ids(req), f"{rid}: runner's block table drifted"
        assert copy.num_computed_tokens == req.num_computed_tokens
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        assert end <= req.num_tokens, f"{rid}: scheduled past its known tokens"
        assert len(copy.block_ids) * self.bs >= end, f"{rid}: no slot for every scheduled token"
        # A block this step writes belongs to this request alone and is not in the cache yet.
        for bid in {copy.block_ids[p // self.bs] for p in range(start, end)}:
            block = self.pool.blocks[bid]
            assert block.ref_cnt == 1 and block.block_hash is None, f"{rid} writes shared/cached block {bid}"

    def _check_admitted(self, rid: str, num_hit: int) -> None:
        req = self.sched.requests[rid]
        assert num_hit == req.num_computed_tokens and num_hit % self.bs == 0
        assert num_hit < req.num_tokens, "the last token must always be computed, for logits"
        if req.params.prompt_logprobs is not None or not (self.kv.enable_prefix_caching or rid in self.leader_of):
            assert num_hit == 0, f"{rid} got prefix-cache hits it may not use"
        leader = self.sched.requests.get(self.leader_of.get(rid, ""))
        if leader is not None:
            assert leader.num_computed_tokens >= leader.num_prompt_tokens, f"{rid} started before its leader's prompt"

    # ---- outputs -----------------------------------------------------------------------

    def _record(self, outs: list[EngineOutput]) -> None:
        for out in outs:
            rid = out.request_id
            assert rid in self.params and rid not in self.ended, f"output for {rid}, not live"
            self.streamed[rid] += out.new_token_ids
            if out.finish_reason is not None:
                self._check_ending(rid, out)

    def _check_ending(self, rid: str, out: EngineOutput) -> None:
        reason, tokens, params = out.finish_reason, self.streamed[rid], self.params[rid]
        assert reason in FINISH_REASONS and rid not in self.sched.requests
        self.ended[rid] = reason
        event(f"finish: {reason}")
        if reason == "error":
            assert out.error, f"{rid} failed without saying why"
            assert rid in self.expect_error or rid in self.oversized, f"{rid} failed though it fits the pool"
        elif rid in self.oversized:
            assert reason == "abort", f"{rid} cannot fit the pool, yet ended with {reason!r}"
        if reason == "stop":
            assert tokens[-1] == EOS and not params.ignore_eos
        if reason == "length":
            assert len(tokens) == params.max_tokens or len(tokens) + self.prompt_len[rid] >= MAX_MODEL_LEN

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def requests_are_accounted_for(self) -> None:
        s = self.sched
        self.sched.check_invariants()
        running, waiting = [r.request_id for r in s.running], [r.request_id for r in s.waiting]
        assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
        assert not set(running) & set(waiting) and set(running) | set(waiting) == set(s.requests)
        assert all(s.requests[r.request_id] is r for r in s.running + s.waiting)
        assert len(s.running) <= s.max_num_seqs
        assert [r.sort_key for r in s.running] == sorted(r.sort_key for r in s.running)
        assert [r.sort_key for r in s.waiting] == sorted(r.sort_key for r in s.waiting)
        for req in s.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.block_ids(req) and req.num_computed_tokens == 0, f"{req.request_id} waits holding KV"
        # Every request is live or ended (exactly once), and its stream matches its tokens.
        assert not set(s.requests) & set(self.ended) and set(s.requests) | set(self.ended) == set(self.params)
        for rid, req in s.requests.items():
            assert self.streamed[rid] == req.output_token_ids

    @invariant()
    def blocks_are_conserved(self) -> None:
        kv, pool = self.kv, self.pool
        live = self.sched.requests
        assert set(kv.blocks) <= set(live) and set(kv.hashes) <= set(live) and set(kv.num_published) <= set(live)
        holders = self._holders()
        for block in pool.blocks:
            assert block.ref_cnt == len(holders[block.block_id]), f"block {block.block_id}: ref_cnt vs tables"
        assert all(b.ref_cnt == 0 for b in pool.free.values())
        assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt) == pool.num_blocks
        assert 0 <= pool.hits <= pool.queries

    def _holders(self) -> dict[int, list[tuple[str, int]]]:
        """Block id -> the (request, position) pairs of live block tables holding it."""
        holders: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for rid, table in self.kv.blocks.items():
            assert len({b.block_id for b in table}) == len(table), f"{rid} holds a block twice"
            for i, block in enumerate(table):
                assert self.pool.blocks[block.block_id] is block
                holders[block.block_id].append((rid, i))
        return holders

    @invariant()
    def tables_are_sound(self) -> None:
        for rid, table in self.kv.blocks.items():
            req, hashes = self.sched.requests[rid], self.kv.hashes.get(rid, [])
            assert len(table) <= self.kv.blocks_needed(req.num_tokens), f"{rid} holds blocks it cannot use"
            assert len(table) * self.bs >= req.num_computed_tokens
            for i, block in enumerate(table):
                if block.block_hash is None:
                    continue
                # A cached block must hold exactly this request's prefix, and be computed.
                assert i < len(hashes) and hashes[i] == block.block_hash, f"{rid}: block {block.block_id} hash"
                assert (i + 1) * self.bs <= req.num_computed_tokens

    @invariant()
    def sharing_is_by_prefix(self) -> None:
        """Two live tables share a block only at the same position under the same prefix hash
        (checked per table above); with the cache off only n > 1 followers may share."""
        for bid, holders in self._holders().items():
            if len(holders) < 2:
                continue
            event("block shared")
            assert len({i for _, i in holders}) == 1, f"block {bid} at different positions: {holders}"
            assert self.pool.blocks[bid].block_hash is not None, f"block {bid} shared without a hash"
            assert len({self.salt[rid] for rid, _ in holders}) == 1, f"block {bid} shared across tenants"
            if not self.kv.enable_prefix_caching:
                originals = [rid for rid, _ in holders if rid not in self.leader_of]
                assert len(originals) <= 1, f"block {bid} shared by {holders} with the prefix cache off"

    def check_all(self) -> None:
        self.requests_are_accounted_for()
        self.blocks_are_conserved()
        self.tables_are_sound()
        self.sharing_is_by_prefix()

    # ---- the end -----------------------------------------------------------------------

    def teardown(self) -> None:
        if not hasattr(self, "sched") or sys.exc_info()[0] is not None:
            return  # a failure is already on its way out; do not bury it
        if self.in_flight is not None:
            self._finish_step(False)
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished():
                break
            self.step(1)
        waiting = {r.request_id: r.status.value for r in self.sched.waiting}
        assert not self.sched.has_unfinished(), f"still unfinished after {MAX_DRAIN_STEPS} steps: {waiting}"
        self.schedule()  # the runner hears of the last finished requests
        assert not self.runner and not self.in_flight.num_scheduled_tokens
        assert set(self.ended) == set(self.params)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert not self.kv.blocks and not self.kv.hashes and not self.kv.num_published
        self.pool.check_invariants()


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_machine = SchedulerMachine.TestCase


# ---- the pool alone, against a model ---------------------------------------------------

HASHES = [f"h{i}".encode() for i in range(6)]
POOL_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 6)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 63), max_size=3)),
        st.tuples(st.just("release"), st.lists(st.integers(0, 63), max_size=4)),
        st.tuples(st.just("cache"), st.integers(0, 63), st.integers(0, len(HASHES) - 1)),
        st.tuples(st.just("lookup"), st.integers(0, len(HASHES) - 1)),
        st.tuples(st.just("reset_cache")),
    ),
    max_size=60,
)


class PoolModel:
    """The pool's documented behaviour, written plainly: an LRU list, counts and a hash map."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))  # least- to most-recently freed
        self.used: set[int] = set()  # handed out at least once
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.evictions = 0

    @property
    def held(self) -> list[int]:
        """One entry per reference taken."""
        return [bid for bid, n in enumerate(self.ref) for _ in range(n)]

    def allocate(self, n: int) -> list[int]:
        taken = [self._take() for _ in range(n)]
        for bid in taken:
            self.evictions += self.hash_of.pop(bid, None) is not None
            self.ref[bid] = 1
        return taken

    def _take(self) -> int:
        """A used hashless block (the most recently freed), else a never-used one (the lowest
        id), else the least recently freed (cached) one."""
        warm = [bid for bid in self.free if bid in self.used and bid not in self.hash_of]
        fresh = [bid for bid in self.free if bid not in self.used]
        bid = warm[-1] if warm else min(fresh) if fresh else self.free[0]
        self.free.remove(bid)
        self.used.add(bid)
        return bid

    def touch(self, bids: list[int]) -> None:
        for bid in bids:
            if self.ref[bid] == 0:
                self.free.remove(bid)
            self.ref[bid] += 1

    def release(self, bids: list[int]) -> None:
        for bid in bids:
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self.free.append(bid)

    def cache(self, bid: int, block_hash: bytes) -> None:
        if bid not in self.hash_of and block_hash not in self.hash_of.values():
            self.hash_of[bid] = block_hash


def run_pool_op(pool: BlockPool, model: PoolModel, op: tuple) -> None:
    kind, args = op[0], op[1:]
    if kind == "allocate":
        if args[0] > len(model.free):
            before = list(pool.free)
            try:
                pool.allocate(args[0])
            except RuntimeError:
                assert list(pool.free) == before, "a refused allocation changed the free queue"
                return
            raise AssertionError("allocated more blocks than were free")
        assert [b.block_id for b in pool.allocate(args[0])] == model.allocate(args[0]), "not the allocation order"
    elif kind == "touch":
        # As the cache manager does: only blocks someone holds or the cache can find.
        candidates = sorted(set(model.held) | set(model.hash_of))
        bids = [candidates[i % len(candidates)] for i in args[0]] if candidates else []
        pool.touch([pool.blocks[b] for b in bids])
        model.touch(bids)
    elif kind == "release":
        held, bids = model.held, []
        for i in args[0]:
            if held:
                bids.append(held.pop(i % len(held)))
        pool.release([pool.blocks[b] for b in bids])
        model.release(bids)
    elif kind == "cache":
        held = sorted(set(model.held))
        if held:
            bid = held[args[0] % len(held)]
            pool.cache(pool.blocks[bid], HASHES[args[1]])
            model.cache(bid, HASHES[args[1]])
    elif kind == "lookup":
        found = pool.lookup(HASHES[args[0]])
        expected = [bid for bid, h in model.hash_of.items() if h == HASHES[args[0]]]
        assert [found.block_id] == expected if found else not expected
    elif kind == "reset_cache" and not any(model.ref):
        pool.reset_cache()
        model.hash_of.clear()


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 10), ops=POOL_OPS)
def test_block_pool_matches_model(num_blocks: int, ops: list[tuple]) -> None:
    pool, model = BlockPool(num_blocks), PoolModel(num_blocks)
    for op in ops:
        run_pool_op(pool, model, op)
        pool.check_invariants()
        assert list(pool.free) == model.free, f"free queue after {op}"
        assert [b.ref_cnt for b in pool.blocks] == model.ref
        assert {b.block_id: b.block_hash for b in pool.blocks if b.block_hash} == model.hash_of
        assert {h: b.block_id for h, b in pool.cached.items()} == {h: bid for bid, h in model.hash_of.items()}
        assert pool.evictions == model.evictions
        assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt) == num_blocks
