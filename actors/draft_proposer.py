"""Draft-model proposer: a smaller (or truncated, or more heavily quantized) model sharing the
target's vocabulary runs k autoregressive steps after each target step.

Its KV cache has its own tensors but the target's block ids and slots, so one block table
serves both and a prefix-cache hit is a hit for the draft too. The draft catches up on every
position the target has made final (prefill chunks, accepted tokens) in the same step, so
any block the target publishes holds the draft's KV as well. Positions written for drafts the
target then rejects are simply overwritten by the next catch-up.
"""

from __future__ import annotations

import torch

from cadenza.actors.kv_tensors import allocate_kv_cache
from cadenza.actors.rejection_sampler import at_position
from cadenza.actors.sampler import apply_penalties_and_masks, draw, sampling_probs
from cadenza.actors.spec_proposal import ProposalInput
from cadenza.actors.varlen_batch import Chunk, build_batch
from cadenza.models.llama import LlamaForCausalLM


class DraftModelProposer:
    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_share_place: str | None = None
    ) -> None:
        self.model = model
        self.block_size = block_size
        model.prepare_kernels()
        self.kv_caches = allocate_kv_cache(model, num_blocks, block_size, kv_share_place)
        self.computed: dict[str, int] = {}  # leading positions holding the draft's KV
        self.probs: dict[str, torch.Tensor] = {}

    def start(self, req_id: str, num_computed: int) -> None:
        self.computed[req_id] = num_computed

    def drop(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.probs.pop(req_id, None)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.probs.get(req_id)

    def propose(self, inputs: list[ProposalInput]) -> dict[str, list[int]]:
        proposing = [i for i in inputs if i.k]
        drafts: dict[str, list[int]] = {i.req_id: [] for i in proposing}
        qs: dict[str, list[torch.Tensor]] = {i.req_id: [] for i in proposing}
        with torch.inference_mode():
            chunks = [c for c in (self._catch_up(i) for i in inputs) if c is not None]
            logits = self._forward(chunks, set(drafts))
            for step in range(max((i.k for i in proposing), default=0)):
                self._sample([i for i in proposing if i.k > step], logits, drafts, qs)
                more = [i for i in proposing if i.k > step + 1]
                if not more:
                    break
                logits = self._forward([self._feed(i, drafts[i.req_id]) for i in more], {i.req_id for i in more})
        for i in proposing:
            if not i.row.params.greedy:
                self.probs[i.req_id] = torch.stack(qs[i.req_id])
        return drafts

    def _catch_up(self, inp: ProposalInput) -> tuple[str, Chunk] | None:
        """Positions the draft lacks, up to the final ones; a proposing request also feeds its
        newest token, whose logits give the first draft."""
        start = min(self.computed.get(inp.req_id, 0), inp.num_valid)
        end = len(inp.token_ids) if inp.k else inp.num_valid
        self.computed[inp.req_id] = end
        if end <= start:
            return None
        return inp.req_id, Chunk(inp.token_ids[start:end], start, inp.block_ids)

    def _feed(self, inp: ProposalInput, drafts: list[int]) -> tuple[str, Chunk]:
        position = len(inp.token_ids) + len(drafts) - 1
        self.computed[inp.req_id] = position + 1
        return inp.req_id, Chunk([drafts[-1]], position, inp.block_ids)

    def _forward(self, chunks: list[tuple[str, Chunk]], wanted: set[str]) -> dict[str, torch.Tensor]:
        """Run the draft over the chunks; logits [V] at the last token of each wanted request."""
        if not chunks:
            return {}
        chunks = sorted(chunks, key=lambda rc: len(rc[1].token_ids) != 1)  # decodes first
        ids, positions, meta = build_batch([c for _, c in chunks], self.block_size, self.model.norm.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        rows = [(rid, meta.query_start_loc[n + 1] - 1) for n, (rid, _) in enumerate(chunks) if rid in wanted]
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[[r for _, r in rows]]).float().cpu()
        return {rid: logits[n] for n, (rid, _) in enumerate(rows)}

    def _sample(
        self,
        active: list[ProposalInput],
        logits: dict[str, torch.Tensor],
        drafts: dict[str, list[int]],
        qs: dict[str, list[torch.Tensor]],
    ) -> None:
        """Draw each active request's next draft from the draft model's own distribution q,
        under the request's settings (greedy: the argmax), and keep q for verification."""
        rows = [at_position(i.row, drafts[i.req_id]) for i in active]
        processed = apply_penalties_and_masks(torch.stack([logits[i.req_id] for i in active]), rows)
        tokens = processed.argmax(dim=-1)
        random = [n for n, r in enumerate(rows) if not r.params.greedy]
        if random:
            q = sampling_probs(processed[random], [rows[n] for n in random])
            q = q / q.sum(dim=-1, keepdim=True)
            tokens[random] = draw(q, [rows[n] for n in random], salt=":draft")
            for j, n in enumerate(random):
                qs[active[n].req_id].append(q[j])
        for n, i in enumerate(active):
            drafts[i.req_id].append(int(tokens[n]))
