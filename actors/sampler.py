"""Sampler: logits -> next tokens (and logprobs) for a batch with per-request settings.

Order as in vLLM: penalties and min_tokens masks on the logits, then greedy rows take the
argmax; the others apply temperature, top-k, top-p, min-p and draw by an exponential race,
each seeded request from its own generator so its tokens never depend on the batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from cadenza.actors.device_copy import take_rows, to_device, upload
from cadenza.actors.device_samples import LogprobTensors
from cadenza.actors.logit_edits import LogitEdits
from cadenza.messages import TokenLogprobs
from cadenza.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about one request."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: tuple[int, ...]  # EOS and stop_token_ids, masked while below min_tokens
    # The grammar's allowed tokens at this position (bool [V']; V' may fall short of the
    # logits' padded vocabulary, whose tail is then banned); None: unconstrained.
    grammar_mask: torch.Tensor | None = None
    edits: LogitEdits | None = None  # the request's, made once (made here for a row built without)

    @property
    def logit_edits(self) -> LogitEdits:
        if self.edits is None:
            self.edits = LogitEdits.of(self.params)
        return self.edits

    def generator(self, salt: str = "") -> torch.Generator | None:
        """Seeded requests draw from a stream keyed by (seed, position): the same tokens alone,
        in any batch, and after preemption, with no generator state to carry around. The salt
        keeps speculative decoding's separate draws (draft, accept) independent of the token's."""
        seed = self.params.seed
        if seed is None:
            return None
        key = hashlib.blake2b(f"{seed}:{len(self.output_ids)}{salt}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [N, V] fp32, one row per request -> (token per row, logprobs per row or None)."""
    tokens, logprobs = sample_on_device(logits, rows)
    token_list = tokens.tolist()
    if logprobs is None:
        return token_list, [None] * len(rows)
    return token_list, logprobs.entries(token_list)


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, LogprobTensors | None]:
    """sample() with its results left where the logits are: no value is read on the host, so
    on a GPU nothing waits for the device (penalties and grammar masks aside)."""
    asked = [r.params.logprobs for r in rows]
    raw = torch.log_softmax(logits, dim=-1) if any(k is not None for k in asked) else None
    logits = apply_penalties_and_masks(logits, rows)
    tokens = logits.argmax(dim=-1)
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random) == len(rows):
        tokens = _sample_random(logits, rows)
    elif random:
        drawn = _sample_random(take_rows(logits, random), [rows[i] for i in random])
        tokens.index_copy_(0, to_device(random, torch.long, tokens.device), drawn)
    return tokens, LogprobTensors.of(raw, tokens, asked) if raw is not None else None


def apply_penalties_and_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    touched = [i for i, r in enumerate(rows) if _edits(r)]
    if not touched:
        return logits
    logits = logits.clone()
    penalised = [i for i in touched if rows[i].params.needs_penalties]
    if len(penalised) == len(rows):  # one batch of scatters for every penalised row
        _penalise(logits, rows)
    elif penalised:
        at = to_device(penalised, torch.long, logits.device)
        some = logits[at]
        _penalise(some, [rows[i] for i in penalised])
        logits[at] = some
    for i in touched:
        _edit_row(logits[i], rows[i])
    return logits


def _edits(r: SamplingRow) -> bool:
    return r.params.edits_logits or len(r.output_ids) < r.params.min_tokens or r.grammar_mask is not None


def _penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (over prompt and output), frequency and presence penalties (over the output)
    for rows [R, V] at once, in place, touching only the ids that occur: a row's ids padded with its own
    first id (a duplicate, which changes nothing), sorted so repeats sit together, then gathered
    and scattered back. Work is R x ids, not R x V (at 32 rows of 228 ids over 49,152 tokens,
    ~10 ms a step as whole-vocabulary passes)."""
    params, device = [r.params for r in rows], logits.device
    column = lambda values: to_device(values, logits.dtype, device)[:, None]  # noqa: E731
    outputs, out_len = _padded([r.output_ids for r in rows], device)
    repetition = [p.repetition_penalty for p in params]
    if any(x != 1.0 for x in repetition):
        seen, seen_len = _padded([r.prompt_ids + r.output_ids for r in rows], device)
        factor, kept = column(repetition), logits.gather(1, seen)
        penalised = torch.where(kept > 0, kept / factor, kept * factor)
        # Every copy of an id writes the same value, so duplicates never race.
        logits.scatter_(1, seen, torch.where((seen_len > 0)[:, None], penalised, kept))
    occurs = torch.arange(outputs.shape[1], device=device)[None, :] < out_len[:, None]
    frequency = column([p.frequency_penalty for p in params])
    logits.scatter_add_(1, outputs, -frequency * occurs.to(logits.dtype))
    ordered = outputs.sort(dim=1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    presence = column([p.presence_penalty for p in params])
    logits.scatter_add_(1, ordered, -presence * (first & (out_len > 0)[:, None]).to(logits.dtype))


def _padded(ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids as one long matrix, each padded with its own first id (0 for an empty row),
    and the rows' true lengths."""
    width = max(1, max(len(x) for x in ids))
    matrix = [x + [x[0] if x else 0] * (width - len(x)) for x in ids]
    lengths = [len(x) for x in ids]
    return to_device(matrix, torch.long, device), to_device(lengths, torch.long, device)


def _edit_row(row: torch.Tensor, r: SamplingRow) -> None:
    """The cheap edits, by index: logit_bias, bad words, allowed ids, the grammar, min_tokens."""
    p = r.params
    if p.logit_bias or p.bad_words_token_ids or p.allowed_token_ids is not None:
        r.logit_edits.apply(row, r.output_ids)
    if r.grammar_mask is not None:
        _apply_grammar(row, r.grammar_mask)
    if len(r.output_ids) < p.min_tokens and r.stop_ids:
        row[list(r.stop_ids)] = float("-inf")
    if (p.allowed_token_ids is not None or r.grammar_mask is not None) and not bool(torch.isfinite(row).any()):
        raise ValueError("no token can be sampled: min_tokens, allowed_token_ids and the grammar leave none")


def _apply_grammar(row: torch.Tensor, allowed: torch.Tensor) -> None:
    n = min(allowed.shape[0], row.shape[0])
    row[:n].masked_fill_(~allowed[:n].to(row.device), float("-inf"))
    row[n:] = float("-inf")


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return draw(sampling_probs(logits, rows), rows)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a random row draws from: temperature, top-k, top-p, then min-p.
    Rows may not sum to 1 after min-p; draw() and the rejection sampler do not need them to."""
    temperature = to_device([r.params.temperature for r in rows], logits.dtype, logits.device)
    logits = logits / temperature[:, None]
    logits = _top_k_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in rows):  # decided on the host: no wait for the device
        min_p = to_device([r.params.min_p for r in rows], probs.dtype, probs.device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def draw(weights: torch.Tensor, rows: list[SamplingRow], salt: str = "") -> torch.Tensor:
    """One token per row in proportion to its (unnormalised) weights.

    Exponential race: argmax(w / E) with E ~ Exp(1) draws from w; it needs no normalising.
    A seeded row's noise comes from its CPU stream whatever the logits' device, so a seed
    gives the same tokens on a GPU as on the CPU; the others draw where the logits are.
    """
    noise = torch.empty_like(weights)
    seeded = [(i, g) for i, r in enumerate(rows) if (g := r.generator(salt)) is not None]
    if len(seeded) < len(rows):
        noise.exponential_()  # the unseeded rows' (the seeded ones are overwritten below)
    if seeded:
        drawn = torch.empty(len(seeded), weights.shape[-1], dtype=weights.dtype)
        for row, (_, g) in zip(drawn, seeded, strict=True):
            row.exponential_(generator=g)
        at = to_device([i for i, _ in seeded], torch.long, noise.device)
        noise.index_copy_(0, at, upload(drawn, noise.device))
    return (weights / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    top_k = [r.params.effective_top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = to_device([k or logits.shape[-1] for k in top_k], torch.long, logits.device)[:, None]
    drop = rank >= k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    drop |= before >= to_device(top_p, logits.dtype, logits.device)[:, None]
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def token_logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """One position's entry (raw: its log-softmax [V]), as a batch of one."""
    tokens = torch.tensor([token], device=raw.device)
    return LogprobTensors.of(raw[None], tokens, [k]).entries([token])[0]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Logprob of each next prompt token under the model (rows of logits predict targets)."""
    raw = torch.log_softmax(logits, dim=-1)
    return [token_logprobs(raw[i], t, k) for i, t in enumerate(targets)]
