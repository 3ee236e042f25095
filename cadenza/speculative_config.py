"""Speculative decoding's settings, shaped like vLLM's `speculative_config` dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, shaped like vLLM's `speculative_config` dict.

    method: "ngram" (prompt lookup: the tokens that followed the last match of the context's
    final n-gram, n from prompt_lookup_max down to prompt_lookup_min) or "draft_model" (`model`,
    any model Cadenza loads that shares the target's vocabulary; draft_num_layers keeps only
    its first layers, a cheaper self-speculative draft). num_speculative_tokens: k drafts per
    step (a request may ask for fewer with SamplingParams.num_speculative_tokens).
    disable_by_batch_size: no drafts while this many requests or more are running, where
    verifying k extra tokens for each stops paying (None: always speculate).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {_SPEC_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft model path or name')
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be at least 1, got {self.draft_num_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the user's dict (as in vLLM), with a clear error for an unknown key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**value)
