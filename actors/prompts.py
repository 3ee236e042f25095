"""Prompts to engine requests, shared by LLM and AsyncLLM: tokenizing, and fanning a request
with n > 1 out into n engine sequences that share the prompt's KV."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from cadenza.actors.output_processor import SequenceState
from cadenza.engine_client import Prompt, TokensPrompt
from cadenza.messages import EngineRequest
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import CompletionOutput, RequestOutput
from cadenza.sampling_params import SamplingParams


@dataclass
class PendingRequest:
    """One prompt in flight: its n sequences, keyed by engine request id."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: dict[str, SequenceState]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs.values())

    def output(self) -> RequestOutput:
        """Every sequence so far, whole (LLM.generate's answer)."""
        seqs = sorted(self.seqs.values(), key=lambda s: s.index)
        return self.request_output(seqs, [s.completion() for s in seqs])

    def request_output(self, seqs: list[SequenceState], completions: list[CompletionOutput]) -> RequestOutput:
        """The one place a RequestOutput is built: whole here, one sequence's delta in the
        streaming clients (stream_client._delta). The prompt's fields come from the first."""
        first = seqs[0]
        prompt_lps = first.prompt_logprobs if first.params.prompt_logprobs is not None else None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_ids,
            prompt_lps,
            completions,
            self.finished,
            first.num_cached_tokens,
            [s.metrics for s in seqs],
        )


def require_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass TokensPrompt or {'prompt_token_ids': [...]} prompts")
    return tokenizer


_SHAPES = "a prompt is a string, a TokensPrompt, {'prompt': str} or {'prompt_token_ids': [...]}"


def tokenize(tokenizer: Tokenizer | None, prompt: Prompt) -> tuple[str | None, list[int]]:
    if isinstance(prompt, TokensPrompt):
        text, ids = None, list(prompt.token_ids)
    elif isinstance(prompt, str):
        text, ids = prompt, require_tokenizer(tokenizer).encode(prompt)
    elif not isinstance(prompt, dict):
        raise ValueError(_SHAPES)
    elif "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
    elif "prompt" in prompt:  # rendered chat templates carry their own special tokens
        text = prompt["prompt"]
        ids = require_tokenizer(tokenizer).encode(text, add_special_tokens=not prompt.get("chat", False))
    else:
        raise ValueError(_SHAPES)
    if not ids:
        raise ValueError("the prompt is empty")
    return text, ids


def fan_out(
    request_id: str,
    text: str | None,
    ids: list[int],
    params: SamplingParams,
    priority: int,
    tokenizer: Tokenizer | None,
    cache_salt: str | None = None,
    session_id: str | None = None,
    resume_from: list[int] | None = None,
) -> tuple[PendingRequest, list[EngineRequest]]:
    """n > 1: child 0 leads, the others follow it (they wait for its prompt KV, then share it);
    seeded children get seed + i, so their samples differ but stay reproducible. resume_from:
    outputs already streamed (n = 1): the engine goes on after them, the stream yields only
    what follows (its text detokenized in their context)."""
    if resume_from and params.n != 1:
        raise ValueError("a resumed request has one sequence (n = 1)")
    pending = PendingRequest(request_id, text, ids, {})
    requests: list[EngineRequest] = []
    for i in range(params.n):
        child = request_id if params.n == 1 else f"{request_id}-{i}"
        child_params = params
        if params.seed is not None and i:
            child_params = msgspec.structs.replace(params, seed=params.seed + i)
        requests.append(
            EngineRequest(
                request_id=child,
                prompt_token_ids=ids,
                sampling_params=child_params,
                priority=priority,
                cache_salt=cache_salt,
                session_id=session_id,
                prefix_leader=requests[0].request_id if requests else None,
                output_token_ids=list(resume_from or ()),
            )
        )
        pending.seqs[child] = SequenceState(i, tokenizer, ids + list(resume_from or ()), child_params)
    return pending, requests
