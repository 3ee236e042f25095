"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens. Free to compute and strong on input-grounded text (edit, summarise,
repeat), where the answer copies runs of the prompt."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from cadenza.actors.spec_proposal import ProposalInput
from cadenza.config import SpeculativeConfig


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens; the longest matching n (from max_n down to min_n) wins, then the latest
    match that has k followers (else the earliest, which has the most)."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Windows of the context without its last token: each match has a follower.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            # The latest match with k followers; a match right before the end has too few.
            full = hits[hits + n + k <= len(tokens)]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k]
    return []


class NgramProposer:
    """Deterministic proposals (q is one-hot), so it keeps no state and no KV."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    def start(self, req_id: str, num_computed: int) -> None:
        pass

    def drop(self, req_id: str) -> None:
        pass

    def propose(self, inputs: list[ProposalInput]) -> dict[str, list[int]]:
        drafts = {i.req_id: propose_ngram(i.token_ids, i.k, self.min_n, self.max_n) for i in inputs if i.k}
        return {rid: d for rid, d in drafts.items() if d}

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return None
