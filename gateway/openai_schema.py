"""Request bodies of the OpenAI-compatible HTTP API, as msgspec Structs.

Unknown fields are refused (a typo must not silently change decoding); the known ones are
OpenAI's plus vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, include_stop_str_in_output). Ranges are
checked again by SamplingParams. OpenAI fields that do not change what is generated here
(IGNORED: storage, routing and reasoning hints) are accepted and named back in the
x-cadenza-ignored-fields header, and logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from cadenza.sampling_params import SamplingParams
from cadenza.structured_outputs import StructuredOutputs

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: the running usage in every chunk


# Accepted, and without effect on what is generated: said so in a header, and logged.
IGNORED = (
    "store", "metadata", "safety_identifier", "reasoning_effort", "verbosity",
    "spaces_between_special_tokens",
)  # fmt: skip
# spaces_between_special_tokens (vLLM) changes only slow tokenizers' decoding; fast ones,
# whose decode this server uses as transformers does, never add those spaces.
# Chat only: audio and web search this server cannot do, OpenAI's moderation and prompt-cache
# hints, and Predicted Outputs (prediction).
CHAT_IGNORED = (
    "audio", "modalities", "moderation", "prediction", "prompt_cache_options", "prompt_cache_retention",
    "web_search_options",
)  # fmt: skip
# Completions only: best_of (more candidates than n, vLLM V1 dropped it too) and suffix
# (fill-in-the-middle, which needs a model trained for it).
COMPLETION_IGNORED = ("best_of", "suffix")


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's response_format: text, json_object, or json_schema with its schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct):
    type: str
    function: FunctionDef


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCallItem(msgspec.Struct):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    # Unset (None): the model's generation_config default where it has one, else the API's.
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
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
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI: token ids as strings
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: PositiveInt | None = None  # keep the prompt's last k tokens
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    bad_words: list[str] | None = None  # never generated (as a word, with or without a leading space)
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None  # vLLM: the prompt's own
    # Structured outputs: vLLM's field, and its older guided_* names (one source at most).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None  # OpenAI's (chat; vLLM takes it on completions too)
    # IGNORED (any value; none changes what is generated)
    store: Any = None
    metadata: Any = None
    # Scheduling (gateway/scheduling.py): priority (vLLM's; lower runs first), OpenAI's
    # service_tier ("flex" is batch work), and prompt_cache_key as the conversation whose
    # prefix stays pinned between turns.
    priority: Priority | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    spaces_between_special_tokens: Any = None

    def ignored_fields(self) -> list[str]:
        return [name for name in (*IGNORED, *self.ignored_here()) if getattr(self, name) is not None]

    @staticmethod
    def ignored_here() -> tuple[str, ...]:
        return ()

    def token_bias(self) -> dict[int, float]:
        try:
            return {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings)") from None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        grammar: StructuredOutputs | None = None,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        """defaults: the model's sampling defaults (models/generation_config.py) for the
        fields this request leaves unset."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        chosen = resolve_sampling(self, defaults or {})
        return SamplingParams(
            structured_outputs=grammar,
            stop_token_ids=list(self.stop_token_ids or []),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.token_bias(),
            allowed_token_ids=self.allowed_token_ids,
            n=self.n,
            **chosen,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


# The API's defaults, where neither the request nor the model's generation_config sets a field.
API_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def resolve_sampling(request: Any, defaults: Mapping[str, float]) -> dict[str, Any]:
    """Each sampling field: the request's, else the model's default, else the API's."""
    chosen = {}
    for name, fallback in API_SAMPLING_DEFAULTS.items():
        value = getattr(request, name, None)
        chosen[name] = value if value is not None else type(fallback)(defaults.get(name, fallback))
    return chosen


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # vLLM's chat extras: how the template renders the conversation.
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    add_special_tokens: bool = False  # the template already wrote BOS and the like
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # OpenAI's deprecated forms of tools and tool_choice
    function_call: str | dict[str, Any] | None = None
    # CHAT_IGNORED (any value)
    audio: Any = None
    modalities: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    web_search_options: Any = None

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")

    @staticmethod
    def ignored_here() -> tuple[str, ...]:
        return CHAT_IGNORED

    @property
    def all_tools(self) -> list[Tool]:
        return list(self.tools or []) + [Tool("function", f) for f in self.functions or []]

    @property
    def requested_tool_choice(self) -> str | dict[str, Any] | None:
        if self.tool_choice is not None or self.function_call is None:
            return self.tool_choice
        call = self.function_call  # the deprecated form: "none", "auto" or {"name": ...}
        return {"type": "function", "function": call} if isinstance(call, dict) else call

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling, kw_only=True):
    # One prompt (text, or its token ids), or several (texts, or token-id lists): a batch.
    prompt: str | list[int | str | list[int]]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    # echo: the prompt comes back before the completion, with its tokens' logprobs when
    # logprobs is set (the first token's is null); with max_tokens 0 only the prompt comes
    # back: how evaluation harnesses score a text.
    echo: bool = False
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # COMPLETION_IGNORED (any value)
    best_of: Any = None
    suffix: Any = None

    def __post_init__(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if isinstance(self.prompt, list) and len({type(p) for p in self.prompt}) > 1:
            raise ValueError("prompt: one prompt's token ids, or several prompts (texts or token-id lists), not a mix")

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: one, unless prompt lists texts or token-id lists."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]

    @staticmethod
    def ignored_here() -> tuple[str, ...]:
        return COMPLETION_IGNORED

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens  # echo_only: the one token is dropped

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        grammar: StructuredOutputs | None = None,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, grammar, defaults)
        if self.echo and logprobs is not None:
            params.prompt_logprobs = max(logprobs, self.prompt_logprobs or 0)
        return params

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
