"""A /v1/chat/completions request's choices: assistant messages, streamed as role, content,
reasoning_content and tool_calls deltas, whole as messages with the thinking and the calls
read from the reply (openai_run holds the trip they share with /v1/completions)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from cadenza.gateway import tool_choice
from cadenza.gateway.logprob_entries import Entry
from cadenza.gateway.openai_run import Admitted, Choice, OpenAIRun, finish_reason
from cadenza.gateway.openai_schema import ChatCompletionRequest
from cadenza.gateway.reasoning import ReasoningTally
from cadenza.gateway.state import GatewayState
from cadenza.outputs import CompletionOutput, RequestOutput


class ChatRun(OpenAIRun):
    ID_PREFIX = "chatcmpl"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    OPERATION = "chat"

    def __init__(
        self,
        state: GatewayState,
        body: ChatCompletionRequest,
        admitted: Admitted,
        headers: Mapping[str, str],
        tools: tool_choice.ToolPlan | None,
    ) -> None:
        super().__init__(state, body, admitted, headers)
        self.tools = tools  # how calls are read from the reply (None: the reply is all content)
        self._tool_deltas: dict[int, tool_choice.ToolDeltas] = {}  # a streamed choice's, by index
        parser = state.reasoning_parser  # "": the reply is all content
        self.reasoning = ReasoningTally(parser) if parser else None

    async def _deltas(self) -> AsyncIterator[RequestOutput]:
        """Every delta, its thinking split from its answer first (when a reasoning parser is set),
        so the streamed chunks, the whole message and the usage read one split."""
        async for delta in super()._deltas():
            if self.reasoning is not None:
                self.reasoning.add(delta.outputs[0])
            yield delta

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.reasoning is not None:
            usage.setdefault("completion_tokens_details", {})["reasoning_tokens"] = self.reasoning.tokens
        return usage

    def _opening_choices(self) -> list[Choice]:
        """OpenAI opens each choice with its role."""
        opening = {"delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        return [{"index": i, **opening} for i in range(self.params.n)]

    def _delta_choices(self, out: CompletionOutput) -> list[Choice]:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.latest.pop(out.index, ("", out.text))
            out = dataclasses.replace(out, text=content)
        thought = {
            "index": out.index,
            "delta": {"reasoning_content": reasoning},
            "logprobs": None,
            "finish_reason": None,
        }
        if self.tools is not None:
            return ([thought] if reasoning else []) + self._tool_chunks(out, self.tools)
        if reasoning and not out.text and not out.finish_reason:  # thinking alone: its logprobs go with it
            return [{**thought, "logprobs": self._logprobs(self.logprobs.of_output(out))}]
        delta = {"reasoning_content": reasoning, "content": out.text} if reasoning else {"content": out.text}
        entries = self.logprobs.of_output(out)
        return [
            {
                "index": out.index,
                "delta": delta,
                "logprobs": self._logprobs(entries),
                "finish_reason": finish_reason(out.finish_reason),
            }
        ]

    def _tool_chunks(self, out: CompletionOutput, tools: tool_choice.ToolPlan) -> list[Choice]:
        """A streamed choice's chunks under tools: content and tool_calls deltas, then the end."""
        deltas = self._tool_deltas.setdefault(out.index, tool_choice.ToolDeltas(tools))
        parts = deltas.feed(out.text) + (deltas.finish() if out.finish_reason else [])
        chunks = [{"index": out.index, "delta": part, "logprobs": None, "finish_reason": None} for part in parts]
        if out.finish_reason:
            finish = self._finish(out.finish_reason, deltas.called)
            chunks.append({"index": out.index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return chunks

    def _final_choices(
        self,
        texts: dict[int, str],
        logprobs: dict[int, list[Entry]],
        reasons: dict[int, str],
        first: RequestOutput | None,
    ) -> list[Choice]:
        return [self._final_choice(i, texts[i], logprobs[i], reasons.get(i)) for i in sorted(texts)]

    def _final_choice(self, index: int, text: str, entries: list[Entry], reason: str | None) -> Choice:
        if self.reasoning is None:
            message, finish = self._message(text, reason)
        else:
            reasoning, content = self.reasoning.whole.get(index, ("", text))
            message, finish = self._message(content, reason)
            message["reasoning_content"] = reasoning or None
        return {"index": index, "message": message, "logprobs": self._logprobs(entries), "finish_reason": finish}

    def _message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason(reason)
        content, calls = self.tools.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason(reason)
        message = {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
        return message, self._finish(reason, called=True)

    def _finish(self, reason: str | None, called: bool) -> str | None:
        """tool_calls when the model chose to call (a forced named function ends with stop, as
        OpenAI's does)."""
        finish = finish_reason(reason)
        if finish == "stop" and called and self.tools is not None and self.tools.mode != "named":
            return "tool_calls"
        return finish

    def _logprobs(self, entries: list[Entry]) -> dict[str, list[Entry]] | None:
        return {"content": entries} if self.wants_logprobs else None
