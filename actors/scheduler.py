"""Continuous-batching scheduler: a token budget per step, running requests first, then
waiting ones in (priority, arrival) order, prompts chunked to fit, preemption by recompute."""

from __future__ import annotations

import bisect
import time

from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.request import Request, RequestStatus

from cadenza.messages import (
    CachedRequestData,
    EngineOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        # NOTE: both lists stay sorted by Request.sort_key, so running[-1] is always the
        # preemption victim and waiting[0] the next to admit.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_ids: list[str] = []
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
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

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_ids, victims = self._allocate_or_preempt(req, n)
            preempted |= victims
            if new_ids is None:
                break
            cached.append(
                CachedRequestData(
                    req_id=req.request_id,
                    new_block_ids=new_ids,
                    num_computed_tokens=req.num_computed_tokens,
                    new_token_ids=req.output_token_ids[req.num_sent_tokens - req.num_prompt_tokens :],
                )
            )
            req.num_sent_tokens = req.num_tokens
            scheduled[req.request_id] = n
            budget -= n
            i += 1
        # Admitting new work right after preempting would only thrash the pool.
        new = [] if preempted else self._admit(budget, scheduled)
        finished, self.finished_ids = self.finished_ids, []
        return SchedulerOutput(
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=finished,
        )

    def _allocate_or_preempt(self, req: Request, n: int) -> tuple[list[int] | None, bool]:
        """Blocks for req's next n tokens, preempting from the tail until they fit.
        None when req itself had to go."""
        preempted = False
        while (new_ids := self.kv.allocate(req, n)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, preempted
        return new_ids, preempted

    def _admit(self, budget: int, scheduled: dict[str, int]) -> list[NewRequestData]:
        new: list[NewRequestData] = []
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
            new.append(
                NewRequestData(
                    req_id=req.request_id,
                    token_ids=req.all_token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.params,
                    block_ids=self.kv.block_ids(req),
                    num_computed_tokens=num_hit,
                )
            )
            scheduled[req.request_id] = n
            budget -= n
        return new

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
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_ids.append(req.request_id)
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineOutput]:
        """Advance every scheduled request by what was computed and sampled; emit deltas."""
        outputs = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            req.num_computed_tokens += n
            self.kv.publish(req)
            output = self._apply(req, out.sampled.get(rid, []))
            output.new_logprobs = out.logprobs.get(rid, [])
            output.new_prompt_logprobs = out.prompt_logprobs.get(rid, [])
            if output.new_token_ids or output.new_prompt_logprobs or output.finish_reason:
                outputs.append(output)
        return outputs

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
        self.kv.forget(req)
        self.finished_ids.append(req.request_id)
        del self.requests[req.request_id]

    def check_invariants(self) -> None:
        self.kv.pool.check_invariants()
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert not set(map(id, self.running)) & set(map(id, self.waiting)), "request both running and waiting"
        held = sum(len(self.kv.block_ids(r)) for r in self.requests.values())
        referenced = sum(b.ref_cnt for b in self.kv.pool.blocks)
        assert held == referenced, f"block tables hold {held} references, pool counts {referenced}"
