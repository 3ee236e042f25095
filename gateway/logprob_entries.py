"""Logprobs in the OpenAI API's shapes: chat's per-token entries with top_logprobs,
completions' parallel lists, and vLLM's prompt_logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cadenza.engine_client import ChatTokenizer
from cadenza.outputs import PositionLogprobs

Entry = dict[str, Any]


@dataclass(frozen=True, slots=True)
class LogprobEntries:
    tokenizer: ChatTokenizer
    top_k: int | None  # top_logprobs asked for (None: logprobs off)
    as_token_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens named token_id:<id>

    def entry(self, token_id: int, logprob: float | None) -> Entry:
        text = f"token_id:{token_id}" if self.as_token_ids else self.tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def at(self, token_id: int, position: PositionLogprobs) -> Entry:
        """The token at one position with its top_logprobs: the chosen token plus the top-k,
        each once with its true rank, so the k best by rank."""
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[: self.top_k]
        entry = self.entry(token_id, position[token_id].logprob)
        entry["top_logprobs"] = [self.entry(t, lp.logprob) for t, lp in ranked]
        return entry

    def of_output(self, out: Any) -> list[Entry]:
        """A delta's (or a sequence's) entries, one per token."""
        if not out.logprobs:
            return []
        return [self.at(token_id, position) for token_id, position in zip(out.token_ids, out.logprobs)]

    def of_prompt(self, prompt_ids: list[int], positions: list[PositionLogprobs | None]) -> list[Entry]:
        """Echoed prompt tokens: the first has no logprob (nothing predicts it)."""
        return [
            {**self.entry(token_id, None), "top_logprobs": None} if position is None else self.at(token_id, position)
            for token_id, position in zip(prompt_ids, positions)
        ]

    def vllm_prompt_logprobs(self, positions: list[PositionLogprobs | None]) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token (the first has none) its candidates by token id."""
        text = self.tokenizer.token_text
        return [
            None
            if pos is None
            else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(t)} for t, lp in pos.items()}
            for pos in positions
        ]


def completion_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """Completions' legacy shape: parallel lists."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": [],
    }
