"""Rejection sampler: verify a request's draft tokens against the target in one forward pass.

For drafts d_1..d_k drawn from the proposer's q, with the target's p at the k + 1 positions:
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from the
residual max(p_j - q_j, 0) and stop; when all k are accepted draw a bonus token from p_{k+1}.
The emitted tokens are then distributed exactly as drawing from p one token at a time
(Leviathan et al. 2023; Chen et al. 2023). A deterministic proposal (n-gram) is q = one-hot,
so d_j is accepted with probability p_j(d_j). Greedy requests accept while d_j is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadenza.actors.sampler import SamplingRow, apply_penalties_and_masks, draw, sampling_probs, token_logprobs
from cadenza.messages import TokenLogprobs


@dataclass(slots=True)
class SpecRow:
    """One request to verify: its sampling state before the drafts, the drafts, and q."""

    base: SamplingRow
    draft_ids: list[int]
    draft_probs: torch.Tensor | None  # [k, V] normalised q per draft; None: deterministic proposal
    # The grammar's mask at each of the k + 1 positions (a draft the grammar refuses has
    # probability 0 under its mask, so it is rejected); None: unconstrained.
    grammar_masks: list[torch.Tensor] | None = None

    def mask_at(self, j: int) -> torch.Tensor | None:
        return self.grammar_masks[j] if self.grammar_masks is not None else None


def at_position(base: SamplingRow, drafts: list[int], grammar_mask: torch.Tensor | None = None) -> SamplingRow:
    """The sampling state after `drafts` were accepted: penalties, min_tokens and the seeded
    stream all see the drafts as outputs."""
    outputs = base.output_ids + drafts
    return SamplingRow(base.params, base.prompt_ids, outputs, base.stop_ids, grammar_mask, base.edits)


def verify(logits: torch.Tensor, rows: list[SpecRow]) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """logits [sum(k_i + 1), V] fp32, request i's k_i + 1 rows in order -> per request the
    emitted tokens (accepted drafts, then one corrected or bonus token) and their logprobs."""
    positions = [at_position(r.base, r.draft_ids[:j], r.mask_at(j)) for r in rows for j in range(len(r.draft_ids) + 1)]
    drafts = torch.tensor([d for r in rows for d in [*r.draft_ids, -1]], device=logits.device)
    processed = apply_penalties_and_masks(logits, positions)
    candidate = processed.argmax(dim=-1)
    accept = candidate == drafts
    random = [i for i, p in enumerate(positions) if not p.params.greedy]
    if random:
        q = _proposal_probs(rows, logits.shape[-1]).to(logits.device)[random]
        accept[random], candidate[random] = _verify_random(processed[random], q, drafts[random], positions, random)
    return _assemble(rows, accept.tolist(), candidate.tolist(), logits, positions)


def _proposal_probs(rows: list[SpecRow], vocab: int) -> torch.Tensor:
    """q per position: the draft's distribution, a one-hot for a deterministic proposal, and
    zeros at each request's bonus position (so its residual is p itself)."""
    parts = []
    for r in rows:
        k = len(r.draft_ids)
        q = torch.zeros(k + 1, vocab)
        if r.draft_probs is not None:
            q[:k] = r.draft_probs[:k]
        elif k:
            q[torch.arange(k), torch.tensor(r.draft_ids)] = 1.0
        parts.append(q)
    return torch.cat(parts)


def _verify_random(
    processed: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, positions: list[SamplingRow], random: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [positions[i] for i in random]
    p = sampling_probs(processed, rows)
    p = p / p.sum(dim=-1, keepdim=True)
    has_draft = drafts >= 0
    idx = drafts.clamp(min=0)[:, None]
    p_d, q_d = p.gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]
    accept = has_draft & (_uniform(rows).to(p.device) * q_d < p_d)
    residual = (p - q).clamp(min=0.0)
    empty = residual.sum(dim=-1) <= 0  # p == q exactly: rejection had probability 0
    residual[empty] = p[empty]
    return accept, draw(residual, rows, salt=":residual")


def _uniform(rows: list[SamplingRow]) -> torch.Tensor:
    """One U(0, 1) per position; seeded requests draw theirs from the (seed, position) stream."""
    u = torch.rand(len(rows))
    for i, r in enumerate(rows):
        g = r.generator(":accept")
        if g is not None:
            u[i] = torch.rand(1, generator=g)[0]
    return u


def _assemble(
    rows: list[SpecRow], accept: list[bool], candidate: list[int], logits: torch.Tensor, positions: list[SamplingRow]
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    want_logprobs = any(r.base.params.logprobs is not None for r in rows)
    raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    tokens, logprobs = [], []
    start = 0
    for r in rows:
        k = len(r.draft_ids)
        n = next((j for j in range(k) if not accept[start + j]), k)
        emitted = r.draft_ids[:n] + [candidate[start + n]]
        tokens.append(emitted)
        lp = r.base.params.logprobs
        logprobs.append(
            None
            if raw is None or lp is None
            else [token_logprobs(raw[start + j], t, lp) for j, t in enumerate(emitted)]
        )
        start += k + 1
    return tokens, logprobs
