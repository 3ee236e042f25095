"""A /v1/completions request's choices: text with completions' parallel-list logprobs, and
echo (the prompt, with its tokens' logprobs, before the completion; with max_tokens 0 in its
place). openai_run holds the trip they share with /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Mapping

from cadenza.gateway.logprob_entries import Entry, completion_logprobs
from cadenza.gateway.openai_run import Admitted, Choice, OpenAIRun, finish_reason
from cadenza.gateway.openai_schema import CompletionRequest
from cadenza.gateway.state import GatewayState
from cadenza.outputs import CompletionOutput, RequestOutput


class CompletionRun(OpenAIRun):
    ID_PREFIX = "cmpl"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    OPERATION = "text_completion"

    def __init__(
        self, state: GatewayState, body: CompletionRequest, admitted: Admitted, headers: Mapping[str, str]
    ) -> None:
        super().__init__(state, body, admitted, headers)
        self.prompt = body.prompt
        self.echo = body.echo
        self.echo_only = body.echo_only  # the prompt alone: the one token generated is dropped

    def _completion_tokens(self) -> int:
        return 0 if self.echo_only else super()._completion_tokens()

    def _prompt_choices(self, first: RequestOutput) -> list[Choice]:
        """Echo: the prompt first, once, in a chunk of its own."""
        if not self.echo:
            return []
        text, entries = self._echoed(first)
        return [self._choice(0, text, entries, "length" if self.echo_only else None)]

    def _delta_choices(self, out: CompletionOutput) -> list[Choice]:
        if self.echo_only:
            return []
        return [self._choice(out.index, out.text, self.logprobs.of_output(out), out.finish_reason)]

    def _final_choices(
        self,
        texts: dict[int, str],
        logprobs: dict[int, list[Entry]],
        reasons: dict[int, str],
        first: RequestOutput | None,
    ) -> list[Choice]:
        if self.echo and first is not None:  # each choice starts with the prompt
            prompt_text, prompt_entries = self._echoed(first)
            for i in texts:
                kept_text, kept_entries = ("", []) if self.echo_only else (texts[i], logprobs[i])
                texts[i], logprobs[i] = prompt_text + kept_text, prompt_entries + kept_entries
        return [self._choice(i, texts[i], logprobs[i], reasons.get(i)) for i in sorted(texts)]

    def _echoed(self, first: RequestOutput) -> tuple[str, list[Entry]]:
        """The prompt's text and, when logprobs were asked, an entry per prompt token (the
        first has no logprob: nothing predicts it)."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.state.tokenizer.decode(self.prompt_ids)
        if not self.wants_logprobs:
            return prompt, []
        positions = first.prompt_logprobs or [None] * len(self.prompt_ids)
        return prompt, self.logprobs.of_prompt(self.prompt_ids, positions)

    def _choice(self, index: int, text: str, entries: list[Entry], reason: str | None) -> Choice:
        logprobs = completion_logprobs(entries) if self.wants_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
