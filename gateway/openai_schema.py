"""Request bodies of the OpenAI-compatible HTTP API, as msgspec Structs.

Unknown fields are refused (a typo must not silently change decoding); the known ones are
OpenAI's plus vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens). Ranges are checked again by SamplingParams.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from cadenza.sampling_params import SamplingParams

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    user: str | None = None
    # vLLM extras
    cache_salt: str | None = None  # mixed into the prefix-cache hashes with the tenant's key
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
