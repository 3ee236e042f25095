"""The validation of one request, in one place: what it may ask of the model, whether it fits
the context, the max_tokens it gets when it does not say, the model it names and the API key
it presents.

`LLM` and `AsyncLLM` (through the engine), the HTTP API and the websocket all call these
functions, so a request is refused before any work, with the same message on every path; a
value that would fail inside a worker's step (a top_k past the vocabulary, a token id the
embedding does not have, thousands of logprobs) included. Each caller keeps its own error
shape: the engine raises these ValueErrors as they are, the gateway turns them into its
RequestError (the subclasses below tell it which code and param). Model-independent ranges
(finite floats, 64-bit integers) are SamplingParams' own checks. Pure functions: nothing here
imports an upper layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cadenza.sampling_params import SamplingParams

# vLLM's default cap on logprobs / prompt_logprobs (its max_logprobs); OpenAI's is 20 too.
DEFAULT_MAX_LOGPROBS = 20
# Stop strings are matched against the text after every delta: their count and length bound
# that work per token.
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_STRING_CHARS = 256
DEFAULT_MAX_STOP_TOKEN_IDS = 64
# Lists a client sends to edit the logits. OpenAI caps logit_bias at 300 entries; the others
# bound the work of building a request's edits (the sampler applies them from tensors made
# once per request, so a step's cost does not grow with them).
DEFAULT_MAX_LOGIT_BIAS = 300
DEFAULT_MAX_ALLOWED_TOKEN_IDS = 16384
DEFAULT_MAX_BAD_WORDS = 128
DEFAULT_MAX_BAD_WORD_TOKENS = 32
# How a request names its prompt and its output budget in messages (the Responses API says
# "input" and "max_output_tokens").
TERMS = ("prompt", "max_tokens")
# Browsers cannot set headers on a websocket; they may offer the key as this subprotocol.
KEY_SUBPROTOCOL = "openai-insecure-api-key."


class ContextLengthError(ValueError):
    """The request does not fit the model's context. field: "prompt" when the prompt alone
    leaves no room to generate, "max_tokens" when the output asked for does not fit after it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickles whole (Ray ships exceptions)
        return type(self), (str(self), self.field)


class UnknownModelError(ValueError):
    """The request names a model this server does not serve."""


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
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_allowed_token_ids: int = DEFAULT_MAX_ALLOWED_TOKEN_IDS
    max_bad_words: int = DEFAULT_MAX_BAD_WORDS
    max_bad_word_tokens: int = DEFAULT_MAX_BAD_WORD_TOKENS


def check_request(params: SamplingParams, prompt_ids: Sequence[int], limits: RequestLimits) -> None:
    """Raises ValueError naming the field and the limit (ContextLengthError for the context);
    returns when the request may run."""
    _check_prompt(prompt_ids, limits)
    check_context(len(prompt_ids), params.max_tokens, limits.max_model_len)
    _check_sampling(params, limits)
    _check_logit_lists(params, limits)
    _check_stops(params, limits)


def context_room(prompt_len: int, max_model_len: int, prompt: str = TERMS[0]) -> int:
    """Tokens the context has left after the prompt: at least 1, else ContextLengthError."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"the {prompt} ({prompt_len} tokens) leaves no room to generate in the model's context "
            f"of max_model_len={max_model_len} tokens",
            "prompt",
        )
    return room


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, terms: tuple[str, str] = TERMS) -> int:
    """The room left after the prompt, once max_tokens (None: not asked) fits in it."""
    room = context_room(prompt_len, max_model_len, terms[0])
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            f"{terms[0]} ({prompt_len} tokens) plus {terms[1]} ({max_tokens}) exceeds the model's context "
            f"of max_model_len={max_model_len} tokens",
            "max_tokens",
        )
    return room


def max_tokens_or_default(
    prompt_len: int, max_tokens: int | None, max_model_len: int, default: int, terms: tuple[str, str] = TERMS
) -> int:
    """The gateway's rule: max_tokens as asked once it fits; not asked, the room left in the
    context, at most `default` (a server's default output budget, not the whole context)."""
    room = check_context(prompt_len, max_tokens, max_model_len, terms)
    return min(default, room) if max_tokens is None else max_tokens


def max_tokens_to_fill(prompt_len: int, max_model_len: int, kv_tokens: int) -> int:
    """The engine's rule for max_tokens=None: as many as fit both the context and the KV pool
    (kv_tokens; a request bigger than the pool would preempt itself and never be admitted again)."""
    room = context_room(prompt_len, max_model_len)
    if kv_tokens - prompt_len < 1:
        raise ValueError(
            f"the prompt ({prompt_len} tokens) leaves no room to generate in the KV pool of {kv_tokens} tokens"
        )
    return min(room, kv_tokens - prompt_len)


def check_model(requested: str | None, served: str) -> None:
    """A request may leave the model out; if it names one, it must be the one served."""
    if requested is not None and requested != served:
        raise UnknownModelError(f"model {requested!r} does not exist here; this server serves {served!r}")


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of `Authorization: Bearer <key>` (stripped; "" if blank), else None.
    headers: lower-case names, or a case-insensitive mapping such as Starlette's Headers."""
    auth = headers.get("authorization", "")
    return auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None


def offered_subprotocols(headers: Mapping[str, str]) -> list[str]:
    """The websocket subprotocols a client offered (Sec-WebSocket-Protocol), in its order."""
    offered = (p.strip() for p in headers.get("sec-websocket-protocol", "").split(","))
    return [p for p in offered if p]


def key_subprotocol(offered: Sequence[str]) -> str | None:
    """The first offered `openai-insecure-api-key.<key>` subprotocol, which the server echoes
    on accepting (a browser refuses a handshake answered with none it offered)."""
    return next((p for p in offered if p.startswith(KEY_SUBPROTOCOL)), None)


def presented_keys(headers: Mapping[str, str], subprotocols: bool = True) -> list[str]:
    """Every key a client sent: the bearer key, then (websocket handshakes: subprotocols) each
    one offered as a subprotocol. Any of them may be the server's key."""
    bearer = bearer_key(headers)
    keys = [bearer] if bearer is not None else []
    offered = offered_subprotocols(headers) if subprotocols else []
    return keys + [p.removeprefix(KEY_SUBPROTOCOL) for p in offered if p.startswith(KEY_SUBPROTOCOL)]


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a client goes by (its tenant and admission quota): `Authorization: Bearer
    <key>`, else (websockets) the first `openai-insecure-api-key.<key>` subprotocol."""
    keys = presented_keys(headers)
    return keys[0] if keys else None


def _check_prompt(prompt_ids: Sequence[int], limits: RequestLimits) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= limits.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {limits.vocab_size})")


def _check_sampling(params: SamplingParams, limits: RequestLimits) -> None:
    if params.effective_top_k > limits.vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary size {limits.vocab_size}, got {params.top_k}")
    cap = limits.vocab_size if limits.max_logprobs < 0 else limits.max_logprobs  # -1: no cap, as in vLLM
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > cap:
            raise ValueError(f"{name} must be at most {cap} (max_logprobs), got {value}")
    if any(not 0 <= t < limits.vocab_size for t in params.allowed_token_ids or []):
        raise ValueError(f"allowed_token_ids must be in [0, {limits.vocab_size})")
    if any(not 0 <= t < limits.vocab_size for word in params.bad_words_token_ids for t in word):
        raise ValueError(f"bad_words token ids must be in [0, {limits.vocab_size})")
    if any(not 0 <= t < limits.vocab_size for t in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {limits.vocab_size})")
    if params.min_tokens >= limits.max_model_len:
        raise ValueError(f"min_tokens ({params.min_tokens}) must be below max_model_len={limits.max_model_len}")


def check_bad_word_count(count: int, limits: RequestLimits) -> None:
    """bad_words as a client sends them (strings, before they are tokenized)."""
    if count > limits.max_bad_words:
        raise ValueError(f"at most {limits.max_bad_words} bad_words (max_bad_words), got {count}")


def _check_logit_lists(params: SamplingParams, limits: RequestLimits) -> None:
    if len(params.logit_bias) > limits.max_logit_bias:
        got = len(params.logit_bias)
        raise ValueError(f"at most {limits.max_logit_bias} logit_bias entries (max_logit_bias), got {got}")
    allowed = params.allowed_token_ids or []
    if len(allowed) > limits.max_allowed_token_ids:
        cap = limits.max_allowed_token_ids
        raise ValueError(f"at most {cap} allowed_token_ids (max_allowed_token_ids), got {len(allowed)}")
    words = params.bad_words_token_ids
    # A word is tokenized twice (as it starts the text and after a space): two sequences each.
    check_bad_word_count((len(words) + 1) // 2, limits)
    if any(len(w) > limits.max_bad_word_tokens for w in words):
        cap = limits.max_bad_word_tokens
        raise ValueError(f"each bad word must be at most {cap} tokens (max_bad_word_tokens)")


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
