"""Continuous-batching scheduler: a token budget per step, running requests first, then
waiting ones in (priority, arrival) order, prompts chunked to fit, preemption by recompute.
Priorities age (priority_aging_s, request.aged_rank): urgent work never starves the rest.

With schedule_ahead (async scheduling) the next step is planned before the last one's
outputs are back: a request's steps in flight are counted as computed (Request.in_flight),
each token they sample as a placeholder the runner fills in itself, and a request whose
outputs in flight may already end it (max_tokens, the context) waits for them."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.request import Request, RequestStatus, aged_rank
from cadenza.config import SpeculativeConfig
from cadenza.messages import (
    CachedRequestData,
    EngineOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from cadenza.stats import SpecDecodeStats, StepTokenStats


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        spec: SpeculativeConfig | None = None,
        request_timeout_s: float | None = None,
        schedule_ahead: bool = False,
        priority_aging_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if schedule_ahead and spec is not None:
            raise ValueError("scheduling ahead cannot speculate: a step's drafts come from its outputs")
        self.schedule_ahead = schedule_ahead
        self.priority_aging_s = priority_aging_s
        self.clock = clock  # when requests were queued, for aging (tests step their own)
        self.kv = kv
        self.request_timeout_s = request_timeout_s
        self.spec = spec
        self.spec_stats = SpecDecodeStats()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        # NOTE: both lists stay sorted by Request.sort_key, so running[-1] is always the
        # preemption victim and waiting[0] the next to admit.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_ids: list[str] = []
        # Requests the scheduler itself ended (deadline passed, can never fit): their outputs
        # wait here for the engine to publish (schedule() returns the step's plan only).
        self.failed: list[EngineOutput] = []
        self.num_preemptions = 0
        self.step_tokens = StepTokenStats()  # tokens per step, for vLLM's iteration_tokens_total

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        req.rank = aged_rank(req.priority, self.clock(), self.priority_aging_s)
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.finish_reason = "abort"
            self._finish(req)
            outputs.append(EngineOutput(request_id=rid, new_token_ids=[], finish_reason="abort"))
        return outputs

    def fail(self, request_ids: list[str], error: str) -> list[EngineOutput]:
        """End these requests alone with an error (their input broke a step, or their deadline
        passed); everyone else goes on."""
        outputs = self.abort(request_ids)
        for out in outputs:
            out.finish_reason, out.error = "error", error
        return outputs

    def take_failed(self) -> list[EngineOutput]:
        failed, self.failed = self.failed, []
        return failed

    def reset_after_worker_loss(self, error: str) -> list[EngineOutput]:
        """The workers were rebuilt and every KV block's contents are gone. Running requests
        fail (their partial output was already streamed); waiting ones, preempted included,
        hold no blocks and run again from their tokens. The prefix-cache index is emptied,
        so nothing is ever served from lost KV."""
        outputs = self.fail([r.request_id for r in self.running], error)
        for req in self.waiting:
            req.num_computed_tokens, req.spec_token_ids = 0, []
            req.in_flight.clear()
        self.kv.reset()
        self.finished_ids.clear()  # the rebuilt workers hold no state to drop
        return outputs

    def schedule(self) -> SchedulerOutput:
        self._expire()
        self.kv.pins.expire()
        budget = self.max_num_batched_tokens
        so = SchedulerOutput()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._output_due(req):
                i += 1
                continue
            new_ids, victims = self._schedule_running(req, budget, so)
            preempted |= victims
            if new_ids is None:
                break
            so.cached_requests.append(
                CachedRequestData(
                    req_id=req.request_id,
                    new_block_ids=new_ids,
                    num_computed_tokens=req.num_planned_tokens,
                    new_token_ids=req.output_token_ids[req.num_sent_tokens - req.num_prompt_tokens :],
                )
            )
            req.num_sent_tokens = req.num_tokens
            budget -= so.num_scheduled_tokens[req.request_id]
            i += 1
        # Admitting new work right after preempting would only thrash the pool.
        if not preempted:
            self._admit(budget, so)
            if not so.num_scheduled_tokens and not self.running:
                self._fail_unadmittable()
        if self.spec is not None:
            self._plan_proposals(so)
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.step_tokens.record(so.total_num_scheduled_tokens)
        so.finished_req_ids, self.finished_ids = self.finished_ids, []
        if self.schedule_ahead:
            self._put_in_flight(so)
        return so

    def _output_due(self, req: Request) -> bool:
        """Ahead only: the outputs in flight may end the request (max_tokens, max_model_len),
        so it waits for them rather than computing a token past its end."""
        placeholders = req.num_placeholders
        if not placeholders:
            return False
        return (
            len(req.output_token_ids) + placeholders >= req.max_tokens
            or req.num_tokens + placeholders >= self.max_model_len
        )

    def _put_in_flight(self, so: SchedulerOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            samples = req.num_planned_tokens + n == req.num_tokens + req.num_placeholders
            req.in_flight.append((n, samples))

    def _schedule_running(self, req: Request, budget: int, so: SchedulerOutput) -> tuple[list[int] | None, bool]:
        """Schedule req's next tokens, with its drafts when they fit; (new block ids or None, preempted)."""
        pending = req.num_tokens + req.num_placeholders - req.num_planned_tokens
        drafts = self._drafts_to_verify(req, budget - pending)
        n = min(pending + len(drafts), budget)
        new_ids = self.kv.allocate(req, n) if drafts else None
        victims = False
        if new_ids is None:  # without drafts, then by preempting
            drafts, n = [], min(pending, budget)
            new_ids, victims = self._allocate_or_preempt(req, n)
            if new_ids is None:
                return None, victims
        so.num_scheduled_tokens[req.request_id] = n
        if drafts:
            so.scheduled_spec_tokens[req.request_id] = drafts
        return new_ids, victims

    def _drafts_to_verify(self, req: Request, budget: int) -> list[int]:
        """req's drafts that fit the step's budget, its max_tokens and the context (each step
        also emits one token of its own), and none while the batch is too large to speculate."""
        if not req.spec_token_ids or self._speculation_off(len(self.running)):
            return []
        room = min(req.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
        return req.spec_token_ids[: max(min(budget, room), 0)]

    def _speculation_off(self, batch_size: int) -> bool:
        limit = self.spec.disable_by_batch_size if self.spec is not None else None
        return self.spec is None or (limit is not None and batch_size >= limit)

    def _plan_proposals(self, so: SchedulerOutput) -> None:
        """How many drafts each scheduled request gets proposed after this step, decided on the
        step's final batch size. A draft model also needs k lookahead slots beyond the
        scheduled tokens, where it writes its KV while proposing; no slots, no drafts."""
        if self._speculation_off(len(so.num_scheduled_tokens)):
            return
        block_ids = {c.req_id: c.new_block_ids for c in so.cached_requests}
        block_ids |= {r.req_id: r.block_ids for r in so.new_requests}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            k = req.params.num_speculative_tokens
            k = self.spec.num_speculative_tokens if k is None else min(k, self.spec.num_speculative_tokens)
            k = min(k, self.max_model_len - req.num_computed_tokens - n)
            if k > 0 and self.spec.method == "draft_model":
                extra = self.kv.allocate(req, n + k)
                if extra is None:
                    continue
                block_ids[rid].extend(extra)
            if k > 0:
                so.num_spec_tokens[rid] = k

    def _allocate_or_preempt(self, req: Request, n: int) -> tuple[list[int] | None, bool]:
        """Blocks for req's next n tokens, preempting from the tail until they fit.
        None when req itself had to go."""
        preempted = False
        while (new_ids := self.kv.allocate(req, n)) is None:
            victim = self.running.pop()
            if victim is req and not self.running:  # alone and still too big: it never fits
                self.running.append(req)
                message = f"the request outgrew the KV pool ({self.kv.pool.num_blocks} blocks) running alone"
                self.failed += self.fail([req.request_id], message)
                return None, preempted
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, preempted
        return new_ids, preempted

    def _admit(self, budget: int, so: SchedulerOutput) -> None:
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[j]
            if self._waits_for_leader(req):
                j += 1
                continue
            hits = self.kv.find_cached(req)
            num_hit = len(hits) * self.kv.block_size
            n = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate(req, n, hits) is None:
                break
            self.waiting.pop(j)
            self._start(req, num_hit)
            req.num_sent_tokens = req.num_tokens
            so.new_requests.append(
                NewRequestData(
                    req_id=req.request_id,
                    token_ids=req.all_token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.params,
                    block_ids=self.kv.block_ids(req),
                    num_computed_tokens=num_hit,
                )
            )
            so.num_scheduled_tokens[req.request_id] = n
            budget -= n

    def _fail_unadmittable(self) -> None:
        """Nothing runs and the pool is free, yet the head of the queue was not admitted: it
        can never fit, so it fails now rather than waiting forever."""
        head = next((r for r in self.waiting if not self._waits_for_leader(r)), None)
        if head is not None and self.kv.pins.num_pinned_blocks:  # pins yield before anything fails
            self.kv.pins.clear()
        elif head is not None:
            message = f"the request needs more KV blocks than the pool's {self.kv.pool.num_blocks}"
            self.failed += self.fail([head.request_id], message)

    def _expire(self) -> None:
        if self.request_timeout_s is None:
            return
        now, limit = time.time(), self.request_timeout_s
        late = [rid for rid, r in self.requests.items() if now - r.arrival_time > limit]
        if late:
            self.failed += self.fail(late, f"the request ran past request_timeout_s={limit:g} s")

    def _start(self, req: Request, num_hit: int) -> None:
        self.kv.record_lookup(req, num_hit)
        if req.status == RequestStatus.WAITING:  # first admission, not a resume
            req.num_cached_tokens = num_hit
            req.queue_time = time.time() - req.arrival_time
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    def _waits_for_leader(self, req: Request) -> bool:
        """n > 1 followers start once the leader's prompt KV exists, then share its blocks."""
        leader = self.requests.get(req.prefix_leader) if req.prefix_leader else None
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def _preempt(self, req: Request) -> None:
        """Recompute-style: drop the KV, keep the tokens, go back to waiting in order."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.in_flight.clear()  # those steps' outputs are dropped: the request is not running
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_ids.append(req.request_id)
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineOutput]:
        """Advance every scheduled request by what was computed and sampled; emit deltas."""
        outputs = self.fail([rid for rid in out.failed if rid in self.requests], "") if out.failed else []
        for output in outputs:
            output.error = out.failed[output.request_id]
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted, failed or preempted meanwhile
            start = req.num_computed_tokens
            tokens = out.sampled.get(rid, [])
            if self.schedule_ahead and not self._landed(req, n, bool(tokens)):
                outputs += self.fail([rid], "internal engine error: a step scheduled ahead sampled no token")
                continue
            drafts = so.scheduled_spec_tokens.get(rid, [])
            accepted = max(len(tokens) - 1, 0) if drafts else 0
            # Rejected drafts' KV is not final: those positions are computed again (overwritten).
            req.num_computed_tokens += n - (len(drafts) - accepted)
            req.spec_token_ids = out.draft_token_ids.get(rid, [])
            self.kv.publish(req)
            output = self._apply(req, tokens)
            if self.schedule_ahead:  # the runner appended its own samples already
                req.num_sent_tokens += len(output.new_token_ids)
            if drafts:
                self._record_spec(req, output, len(drafts), accepted)
            output.new_logprobs = out.logprobs.get(rid, [])[: len(output.new_token_ids)]
            output.new_prompt_logprobs = self._new_prompt_logprobs(req, start, out.prompt_logprobs.get(rid, []))
            if output.new_token_ids or output.new_prompt_logprobs or output.finish_reason:
                outputs.append(output)
        return outputs

    @staticmethod
    def _landed(req: Request, n: int, sampled: bool) -> bool:
        """The oldest step in flight for req came back; False if it disagrees with the plan
        (a sample was due and none came), which would leave a placeholder never filled."""
        planned, samples = req.in_flight.popleft() if req.in_flight else (None, False)
        return planned == n and sampled >= samples

    @staticmethod
    def _new_prompt_logprobs(req: Request, start: int, logprobs: list) -> list:
        """Positions [start, start + len) were computed; after a preemption the prompt is
        computed again from 0, and positions already reported must not be sent twice."""
        new = logprobs[max(req.num_prompt_logprobs - start, 0) :]
        req.num_prompt_logprobs = max(req.num_prompt_logprobs, start + len(logprobs))
        return new

    def _record_spec(self, req: Request, output: EngineOutput, num_drafts: int, accepted: int) -> None:
        req.num_drafts += 1
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += accepted
        self.spec_stats.record(num_drafts, accepted)
        output.num_draft_tokens, output.num_accepted_tokens = num_drafts, accepted

    def _apply(self, req: Request, tokens: list[int]) -> EngineOutput:
        accepted: list[int] = []
        for token in tokens:
            req.output_token_ids.append(token)
            accepted.append(token)
            if req.check_stop(self.max_model_len):
                self._finish(req)
                break
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=accepted,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
            queue_time=req.queue_time,
        )

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        if req.finish_reason in ("stop", "length"):  # a turn that ended; an aborted one frees all
            self.kv.pin_session(req)
        self.kv.forget(req)
        self.finished_ids.append(req.request_id)
        del self.requests[req.request_id]

    def check_invariants(self) -> None:
        self.kv.pool.check_invariants()
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert not set(map(id, self.running)) & set(map(id, self.waiting)), "request both running and waiting"
        held = sum(len(self.kv.held_block_ids(r)) for r in self.requests.values())
        referenced = sum(b.ref_cnt for b in self.kv.pool.blocks)
        assert held == referenced, f"block tables hold {held} references, pool counts {referenced}"
