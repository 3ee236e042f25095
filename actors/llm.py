"""LLM: the offline API. `LLM(model=...).generate(prompts, params)` as in vLLM."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm import tqdm

from cadenza.actors.engine_core import EngineCore, model_thread
from cadenza.actors.prompts import PendingRequest, fan_out, require_tokenizer, tokenize
from cadenza.config import DEFAULT_MODEL, EngineConfig
from cadenza.device import visible_gpus
from cadenza.engine_client import Prompt, TokensPrompt
from cadenza.models.loader import load_model
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import RequestOutput
from cadenza.sampling_params import SamplingParams
from cadenza.stats import EngineStats

Messages = list[dict[str, Any]]


class LLM:
    """An engine in this process. Engine arguments (block_size, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, max_model_len, num_blocks, kv_cache_memory,
    scheduling_policy) are EngineConfig's."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", seed: int = 0, **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, seed=seed, **engine_args).placed(visible_gpus())
        torch.manual_seed(seed)
        if self.config.schedules_ahead:  # the steps' model work runs on a thread: load there too
            loaded, self.engine = EngineCore.load_on(model_thread(), self.config)
        else:
            loaded = load_model(model, self.config.weight_format, self.config.device, self.config.max_model_len)
            self.engine = EngineCore.in_process(self.config, loaded)
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        return require_tokenizer(self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        session_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """session_ids: the conversation each prompt is a turn of (its prefix is pinned)."""
        prompts = [prompts] if isinstance(prompts, (str, dict, TokensPrompt)) else list(prompts)
        params = self._per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        sessions = list(session_ids) if session_ids is not None else [None] * len(prompts)
        if len(priorities) != len(prompts) or len(sessions) != len(prompts):
            raise ValueError(
                f"got {len(priorities)} priorities, {len(sessions)} session ids for {len(prompts)} prompts"
            )
        pending = [self._add(*args) for args in zip(prompts, params, priorities, sessions)]
        self._run(pending, use_tqdm and len(pending) > 1)
        return [p.output() for p in pending]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt": tokenizer.apply_chat_template(c, add_generation_prompt), "chat": True} for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one request as they are sampled (n must be 1)."""
        pending = self._add(prompt, sampling_params or SamplingParams(), 0)
        (seq,) = pending.seqs.values()
        while not pending.finished and self.engine.has_unfinished():
            self._step(pending_by_id={rid: pending for rid in pending.seqs})
            if delta := seq.visible_delta():
                yield delta
        if delta := seq.visible_delta():
            yield delta

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _per_prompt(self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None or isinstance(sp, SamplingParams):
            return [sp or SamplingParams()] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        return list(sp)

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int, session: str | None = None) -> PendingRequest:
        if params.structured_outputs is not None:  # a grammar that cannot compile: refused here
            params.structured_outputs.check()
        text, ids = tokenize(self.tokenizer, prompt)
        rid = str(self._next_id)
        self._next_id += 1
        pending, requests = fan_out(rid, text, ids, params, priority, self.tokenizer, session_id=session)
        for req in requests:
            self.engine.add_request(req)
        return pending

    def _run(self, pending: list[PendingRequest], use_tqdm: bool) -> None:
        by_id = {rid: p for p in pending for rid in p.seqs}
        bar = tqdm(total=len(pending), desc="Processed prompts", disable=not use_tqdm)
        done = 0
        while self.engine.has_unfinished():
            self._step(by_id)
            finished = sum(p.finished for p in pending)
            bar.update(finished - done)
            done = finished
        bar.close()

    def _step(self, pending_by_id: dict[str, PendingRequest]) -> None:
        for out in self.engine.step():
            pending = pending_by_id.get(out.request_id)
            if pending is not None and pending.seqs[out.request_id].process(out):
                self.engine.abort([out.request_id])  # a stop string ended it
