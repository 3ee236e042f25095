"""SamplingParams: how one request is decoded. Field names follow vLLM so users can switch."""

from __future__ import annotations

import math

import msgspec

from cadenza.structured_outputs import StructuredOutputs

# top_k values meaning "no top-k filter" (vLLM accepted -1 before it settled on 0).
_TOP_K_OFF = (0, -1)
# Below this temperature sampling is greedy, as in vLLM: dividing logits by ~0 overflows to
# inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5
_INT64_MAX = (1 << 63) - 1
_UINT64_MAX = (1 << 64) - 1


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request decoding settings; validated when made, so a bad value never reaches the engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before
    # sampling (-100 bans it, +100 all but forces it); applied with the penalties.
    logit_bias: dict[int, float] = {}
    # vLLM's allowed_token_ids: when given, only these tokens can be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, tokenized: a sequence's last token is banned wherever the output
    # ends with the rest of it (a one-token word is banned everywhere).
    bad_words_token_ids: list[list[int]] = []
    # Speculative decoding: at most this many drafts per step for this request (0: none);
    # None takes the engine's speculative_config. Ignored when speculation is off.
    num_speculative_tokens: int | None = None
    # The output must match this grammar (JSON schema, regex, choice, Lark/GBNF): the sampler
    # masks every token the grammar cannot take next.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_numbers()
        self._check_counts()
        self._check_distribution()
        self._check_penalties()

    def _check_numbers(self) -> None:
        """Every integer within int64 (torch's index type) and every float finite: a value
        past either fails inside a worker's step instead of here."""
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        ints = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "num_speculative_tokens")
        for name in ints:
            value = getattr(self, name)
            if value is not None and not -_INT64_MAX <= value <= _INT64_MAX:
                raise ValueError(f"{name} is out of range (a 64-bit signed integer), got {value}")
        if self.seed is not None and not -_INT64_MAX - 1 <= self.seed <= _UINT64_MAX:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if any(not -_INT64_MAX <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (64-bit integers)")

    def _check_counts(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be non-negative, got {self.num_speculative_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def _check_distribution(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 and self.top_k not in _TOP_K_OFF:
            raise ValueError(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
        if any(not -_INT64_MAX <= t <= _INT64_MAX for t in self.allowed_token_ids or []):
            raise ValueError("allowed_token_ids must be token ids (64-bit integers)")
        if any(not word for word in self.bad_words_token_ids):
            raise ValueError("bad_words must not be empty strings")
        if any(not -_INT64_MAX <= t <= _INT64_MAX for word in self.bad_words_token_ids for t in word):
            raise ValueError("bad_words_token_ids must be token ids (64-bit integers)")
        if any(not -_INT64_MAX <= t <= _INT64_MAX for t in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (64-bit integers)")
        if any(not (math.isfinite(v) and -100.0 <= v <= 100.0) for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below GREEDY_TEMPERATURE) means argmax, as in vLLM and the OpenAI API."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in _TOP_K_OFF else self.top_k

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, bias)."""
        return (
            self.needs_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )
