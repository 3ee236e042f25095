"""One /v1/chat/completions or /v1/completions request's trip through the engine, answered as
SSE chunks or one JSON body.

The trip is shared here: the admission places it holds (given back once, whichever path ends
it first), the engine stream fed to its StreamTally, usage, the envelope and the SSE framing.
What differs between the two APIs is how a choice reads, so each renders its own:
chat_run.ChatRun (roles, messages, tool calls) and completion_run.CompletionRun (text, echo).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.gateway.grammar_budget import GrammarPlace
from cadenza.gateway.logprob_entries import Entry, LogprobEntries
from cadenza.gateway.observe import Observation
from cadenza.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from cadenza.gateway.state import GatewayState, new_id
from cadenza.gateway.stream_tally import StreamTally
from cadenza.outputs import CompletionOutput, RequestOutput
from cadenza.sampling_params import SamplingParams

Body = ChatCompletionRequest | CompletionRequest
Choice = dict[str, Any]
_SERVER = "server_error"


@dataclass(frozen=True, slots=True)
class Admitted:
    """A prepared request that holds its places: what it asks of the engine, and whose places
    it gives back when it ends."""

    prompt_ids: list[int]
    params: SamplingParams
    client: str  # whose admission place it holds
    grammar: GrammarPlace  # its places in the grammar quota, given back with the other
    priority: int = 0  # gateway/scheduling.py
    cache_salt: str | None = None  # state.tenant_salt: whose prefix cache it may share


class OpenAIRun:
    """The shared trip. A subclass names its ids and objects and renders choices: the chunks
    before any delta (_opening_choices), at the first delta (_prompt_choices), for a delta's
    completion (_delta_choices), and the whole body's (_final_choices)."""

    ID_PREFIX: ClassVar[str]
    OBJECT: ClassVar[str]  # the JSON body's
    CHUNK_OBJECT: ClassVar[str]  # each SSE chunk's
    OPERATION: ClassVar[str]  # the trace span's and the metrics'

    def __init__(self, state: GatewayState, body: Body, admitted: Admitted, headers: Mapping[str, str]) -> None:
        self.state, self.body, self.admitted = state, body, admitted
        self.prompt_ids, self.params = admitted.prompt_ids, admitted.params
        self.id = new_id(self.ID_PREFIX)
        self.created = int(time.time())
        self.tally = StreamTally(Observation(state.metrics, state.tracing, self.OPERATION, headers, admitted.params))
        self.logprobs = LogprobEntries(state.tokenizer, admitted.params.logprobs, body.return_tokens_as_token_ids)
        self.released = False

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    async def _deltas(self) -> AsyncIterator[RequestOutput]:
        body, admitted, tally = self.body, self.admitted, self.tally
        stream = self.state.generate(
            self.prompt_ids, self.params, self.id, body.stream, admitted.cache_salt, admitted.priority,
            body.prompt_cache_key,
        )  # fmt: skip
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    tally.add(delta)
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or was cut: aborted
            tally.finish(self.id, len(self.prompt_ids), ["abort"])
            raise
        except BaseException as e:
            tally.fail(e)
            raise
        finally:
            self.release()
        tally.finish(self.id, len(self.prompt_ids))

    def release(self) -> None:
        """Give the admission place back, once, whichever path ends the run first."""
        if not self.released:
            self.released = True
            self.state.admission.release(self.admitted.client)
            self.admitted.grammar.release()

    def close_stream(self) -> None:
        """The end of its SSE response, however it came: the place (when the engine work has
        not given it back already) and the stream."""
        self.release()
        self.state.admission.close_stream(self.admitted.client)

    def _completion_tokens(self) -> int:
        return self.tally.completion_tokens

    def usage(self) -> dict[str, Any]:
        prompt, completion = len(self.prompt_ids), self._completion_tokens()
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.tally.cached_tokens},
        }
        if self.state.speculative:  # OpenAI's Predicted Outputs fields, for the model's own drafts
            spec = self.tally.observation.acceptance()
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": spec["num_accepted_tokens"],
                "rejected_prediction_tokens": spec["num_draft_tokens"] - spec["num_accepted_tokens"],
            }
        return usage

    async def whole(self) -> dict[str, Any]:
        logprobs: dict[int, list[Entry]] = {}  # texts and finish reasons are the tally's
        first: RequestOutput | None = None
        async for delta in self._deltas():
            first = first or delta
            out = delta.outputs[0]
            logprobs.setdefault(out.index, []).extend(self.logprobs.of_output(out))
        choices = self._final_choices(dict(self.tally.texts), logprobs, self.tally.reasons, first)
        body = self._envelope(choices, usage=self.usage())
        if self.body.prompt_logprobs is not None:
            positions = (first.prompt_logprobs if first else None) or [None] * len(self.prompt_ids)
            body["prompt_logprobs"] = self.logprobs.vllm_prompt_logprobs(positions)
        return body

    async def sse(self) -> AsyncIterator[str]:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        running = bool(options and options.continuous_usage_stats)  # vLLM: usage in every chunk
        deltas = self._deltas()
        try:
            for choice in self._opening_choices():
                yield sse_event(self._envelope([choice], chunk=True))
            first = True
            async for delta in deltas:
                if first:
                    first = False
                    for choice in self._prompt_choices(delta):
                        yield sse_event(self._envelope([choice], chunk=True))
                out = delta.outputs[0]
                if not (out.text or out.finish_reason):
                    continue
                for choice in self._delta_choices(out):
                    yield sse_event(self._envelope([choice], usage=self.usage() if running else None, chunk=True))
            if include_usage:
                yield sse_event(self._envelope([], usage=self.usage(), chunk=True))
        except (RequestFailedError, EngineDeadError, ValueError) as e:
            yield sse_event({"error": {"message": str(e), "type": "server_error", "param": None, "code": _SERVER}})
        finally:  # a stream cut at a yield aborts its engine request now, not at garbage collection
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    def _envelope(self, choices: list[Choice], usage: dict[str, Any] | None = None, chunk: bool = False) -> dict:
        obj = self.CHUNK_OBJECT if chunk else self.OBJECT
        model = self.state.model_name
        body = {"id": self.id, "object": obj, "created": self.created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def _opening_choices(self) -> list[Choice]:
        """Streamed before the engine's first delta."""
        return []

    def _prompt_choices(self, first: RequestOutput) -> list[Choice]:
        """Streamed once, at the engine's first delta, before its completion."""
        return []

    def _delta_choices(self, out: CompletionOutput) -> list[Choice]:
        """The chunks of one delta's completion (one with text or a finish reason)."""
        raise NotImplementedError

    def _final_choices(
        self,
        texts: dict[int, str],
        logprobs: dict[int, list[Entry]],
        reasons: dict[int, str],
        first: RequestOutput | None,
    ) -> list[Choice]:
        """The whole body's choices: each sequence's text, logprob entries and finish reason
        by index, and the first delta (None when there was none)."""
        raise NotImplementedError


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason: length as it is, any other end (EOS, a stop string or token) stop."""
    return reason if reason == "length" or not reason else "stop"


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
