"""EngineClient: what the gateway (and anything else that serves requests) needs of an engine.

Two implementations: `cadenza.actors.async_llm.AsyncLLM` (the engine and its workers are Ray
actors) and `cadenza.actors.inprocess_client.InProcessClient` (the engine steps in this
process, no Ray). The gateway is typed against this Protocol only, so it never imports the
engine, nor Ray with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from cadenza.outputs import RequestOutput
from cadenza.request_limits import RequestLimits
from cadenza.sampling_params import SamplingParams
from cadenza.stats import ServingStats


class TokensPrompt(msgspec.Struct, frozen=True):
    """A prompt already tokenized (the gateway renders and encodes its own): the engine takes
    the ids as they are, with no tokenizer and no special tokens added."""

    token_ids: list[int]


# A string, a TokensPrompt, or the dicts LLM and AsyncLLM users write (docs/python-api.md): {"prompt": str}
# (a rendered chat template: {"prompt": str, "chat": True}) or {"prompt_token_ids": [...]}.
Prompt = str | TokensPrompt | dict[str, Any]


class ChatTokenizer(Protocol):
    """The tokenizer calls the gateway makes (cadenza.models.tokenizer.Tokenizer has them)."""

    eos_token_ids: tuple[int, ...]
    chat_template: str | None  # read for tool support (does it render tools itself?)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> str: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> Any: ...  # a models.chat_spans.RenderedChat (the base layer names no model code)

    def encode_chat(self, chat: Any, add_special_tokens: bool = False) -> list[int]: ...


class EngineClient(Protocol):
    """max_model_len: the context the engine serves; request_limits: what one request may ask
    (the gateway runs the engine's own checks on them before any work); speculative: whether
    the engine speculates (streams then report accepted drafts)."""

    max_model_len: int
    request_limits: RequestLimits

    @property
    def speculative(self) -> bool: ...

    def get_tokenizer(self) -> ChatTokenizer: ...

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        pace: bool = False,
        cache_salt: str | None = None,
        session_id: str | None = None,
        resume_from: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request; leaving the iteration early aborts it. pace: spread a step's
        several tokens over time; cache_salt: whose prefix cache it may share; session_id: the
        conversation it is a turn of (its prefix stays pinned); resume_from: outputs it already
        produced elsewhere (it goes on after them, as a preempted request). Raises ValueError for a
        request the engine refuses, cadenza.errors.RequestFailedError when the engine ends it
        with an error, cadenza.errors.EngineDeadError when the engine is gone."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> ServingStats: ...

    async def check_health(self) -> None:
        """Raises (EngineDeadError) when the engine cannot serve."""
        ...

    def shutdown(self) -> None: ...
