"""The checks of one request against the model it runs on, in one place.

`LLM`, `AsyncLLM` (through the engine), the HTTP API and the websocket all call
`check_request`, so a value that would fail inside a worker's step (a top_k past the
vocabulary, a token id the embedding does not have, thousands of logprobs) is refused
before any work, with the same message on every path. Model-independent ranges (finite
floats, 64-bit integers) are SamplingParams' own checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cadenza.sampling_params import SamplingParams

# vLLM's default cap on logprobs / prompt_logprobs (its max_logprobs); OpenAI's is 20 too.
DEFAULT_MAX_LOGPROBS = 20
# Stop strings are matched against the text after every delta: their count and length bound
# that work per token.
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_STRING_CHARS = 256
DEFAULT_MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request may ask of this model. vocab_size and max_model_len come from the
    model; the caps are EngineConfig settings of the same names."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS


def check_request(params: SamplingParams, prompt_ids: Sequence[int], limits: RequestLimits) -> None:
    """Raises ValueError naming the field and the limit; returns when the request may run."""
    _check_prompt(prompt_ids, limits)
    _check_sampling(params, limits)
    _check_stops(params, limits)


def _check_prompt(prompt_ids: Sequence[int], limits: RequestLimits) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= limits.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {limits.vocab_size})")
    if len(prompt_ids) >= limits.max_model_len:
        raise ValueError(
            f"the prompt is {len(prompt_ids)} tokens; the model's context (max_model_len) is {limits.max_model_len}"
        )


def _check_sampling(params: SamplingParams, limits: RequestLimits) -> None:
    if params.effective_top_k > limits.vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary size {limits.vocab_size}, got {params.top_k}")
    cap = limits.vocab_size if limits.max_logprobs < 0 else limits.max_logprobs  # -1: no cap, as in vLLM
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > cap:
            raise ValueError(f"{name} must be at most {cap} (max_logprobs), got {value}")
    if params.max_tokens is not None and params.max_tokens >= limits.max_model_len:
        raise ValueError(f"max_tokens ({params.max_tokens}) must be below max_model_len={limits.max_model_len}")
    if params.min_tokens >= limits.max_model_len:
        raise ValueError(f"min_tokens ({params.min_tokens}) must be below max_model_len={limits.max_model_len}")


def _check_stops(params: SamplingParams, limits: RequestLimits) -> None:
    if len(params.stop) > limits.max_stop_strings:
        raise ValueError(f"at most {limits.max_stop_strings} stop strings (max_stop_strings), got {len(params.stop)}")
    if any(len(s) > limits.max_stop_string_chars for s in params.stop):
        raise ValueError(f"stop strings must be at most {limits.max_stop_string_chars} characters")
    ids = params.stop_token_ids
    if len(ids) > limits.max_stop_token_ids:
        raise ValueError(f"at most {limits.max_stop_token_ids} stop_token_ids (max_stop_token_ids), got {len(ids)}")
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise ValueError(f"stop_token_ids must be in [0, {limits.vocab_size})")
