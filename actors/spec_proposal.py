"""What a speculative proposer gets after each step and what it promises: the seam between the
model runner and the n-gram or draft-model proposers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cadenza.actors.sampler import SamplingRow


@dataclass(slots=True)
class ProposalInput:
    """One request of the step just run, as the runner knows it after sampling."""

    req_id: str
    token_ids: list[int]  # every known token, including those sampled this step
    block_ids: list[int]
    num_valid: int  # leading positions whose target KV is final (rejected drafts' are not)
    k: int  # drafts wanted for the next step; 0 still lets a draft model keep its KV in step
    row: SamplingRow  # how the request samples: drafts follow the same settings


class Proposer(Protocol):
    def start(self, req_id: str, num_computed: int) -> None:
        """A request (new or resumed) whose first num_computed positions already have KV."""

    def drop(self, req_id: str) -> None:
        """The request finished or was preempted."""

    def propose(self, inputs: list[ProposalInput]) -> dict[str, list[int]]:
        """Draft tokens per request (at most its k; possibly none)."""

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """q for the request's last drafts ([k, V]), or None for a deterministic proposal."""
