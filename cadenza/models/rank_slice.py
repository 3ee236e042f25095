"""One worker's part of each checkpoint tensor, cut as the tensor is read.

A TP rank (and a PP stage) loads only what it keeps: the model is allocated at its sharded
shapes (shard_model on the meta device), and each HF tensor is narrowed to the rank's rows
or columns before it is copied in, so the full model never exists in the worker's memory;
the peak is about one full tensor (the one being read) plus the rank's part. The cuts are
those of models/tp.py (the layout shard_model gives a loaded model), so both ways agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.config import ModelConfig
from cadenza.models.moe import expert_of
from cadenza.models.partition import expert_slice
from cadenza.models.tp import TPGroup, head_slice, padded_vocab_slice, split_evenly

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
Tensor = torch.Tensor | PackedWeight


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a tensor's kept part goes: the local name, the part, its row offset in a fused weight."""

    name: str
    tensor: Tensor
    offset: int | None


class RankSlicer:
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, layers: tuple[int, int], first: bool, last: bool, expert_parallel: bool
    ) -> None:
        self.cfg, self.tp, self.layers, self.first, self.last = cfg, tp, layers, first, last
        self.experts = expert_slice(cfg.num_experts, tp.size, tp.rank) if expert_parallel and cfg.num_experts else None
        self.expert_ff = split_evenly(cfg.moe_intermediate_size, tp.size, tp.rank)
        heads, d = head_slice(cfg, tp.size, tp.rank), cfg.head_dim
        self.q = (heads.q_start * d, heads.q_end * d)
        self.kv = (heads.kv_start * d, heads.kv_end * d)
        self.ff = split_evenly(cfg.intermediate_size, tp.size, tp.rank)
        self.vocab = padded_vocab_slice(cfg.vocab_size, tp.size, tp.rank)

    def cuts(self, name: str, tensor: Tensor) -> list[Cut]:
        """This worker's parts of one HF tensor (none when it keeps nothing of it)."""
        if name == EMBED:  # a tied LM head is the embedding again, on the last stage
            tied = self.last and self.cfg.tie_word_embeddings
            return [
                Cut(n, self._vocab_rows(tensor), None) for n, keep in ((EMBED, self.first), (LM_HEAD, tied)) if keep
            ]
        if name == LM_HEAD:
            return [Cut(name, self._vocab_rows(tensor), None)] if self.last and not self.cfg.tie_word_embeddings else []
        if name == "model.norm.weight":
            return [Cut(name, tensor, None)]  # every stage holds the (tiny) final norm
        prefix, _, rest = name.partition(".layers.")
        index, _, leaf = rest.partition(".")
        if not index.isdigit() or not self.layers[0] <= int(index) < self.layers[1]:
            return []
        local = f"{prefix}.layers.{int(index) - self.layers[0]}.{leaf}"
        cut = self._layer_part(leaf, tensor)
        return [] if cut is None else [Cut(local, cut[0], cut[1])]

    def _layer_part(self, leaf: str, t: Tensor) -> tuple[Tensor, int | None] | None:
        if self.tp.size == 1:
            return t, None  # the loader's own offsets hold
        expert = expert_of(leaf)
        if expert is not None:
            return self._expert_part(expert, leaf, t)
        q, kv, ff = self.q, self.kv, self.ff
        q_local, kv_local = q[1] - q[0], kv[1] - kv[0]
        rows = {
            "self_attn.q_proj": (q, 0),
            "self_attn.k_proj": (kv, q_local),
            "self_attn.v_proj": (kv, q_local + kv_local),
            "mlp.gate_proj": (ff, 0),
            "mlp.up_proj": (ff, ff[1] - ff[0]),
        }
        proj, _, kind = leaf.rpartition(".")
        if proj in rows:
            (start, end), offset = rows[proj]
            return _dense(t, leaf).narrow(0, start, end - start), offset
        columns = {"self_attn.o_proj": q, "mlp.down_proj": ff}
        if proj in columns and kind == "weight":
            start, end = columns[proj]
            return _dense(t, leaf).narrow(1, start, end - start), None
        if proj in columns:  # a row-parallel bias: added once, by rank 0, after the all-reduce
            return (t, None) if self.tp.rank == 0 else None
        return t, None  # norms: whole on every rank

    def _expert_part(self, expert: tuple[int, str], leaf: str, t: Tensor) -> tuple[Tensor, int | None] | None:
        """The router whole; under expert parallelism this rank's experts whole, else every
        expert's slice of I. The loader places them from the sharded layer's own geometry."""
        index, role = expert
        if role == "router":
            return t, None
        if self.experts is not None:
            return (t, None) if self.experts[0] <= index < self.experts[1] else None
        start, end = self.expert_ff
        return _dense(t, leaf).narrow(1 if role == "down" else 0, start, end - start), None

    def _vocab_rows(self, t: Tensor) -> Tensor:
        if self.tp.size == 1:
            return t
        start, end = self.vocab
        t = _dense(t, EMBED)
        if end > t.shape[0]:  # the last slice's padding rows: zeros, sliced off the logits
            t = torch.cat([t, t.new_zeros(end - t.shape[0], t.shape[1])])
        return t.narrow(0, start, end - start)


def _dense(t: Tensor, name: str) -> torch.Tensor:
    if isinstance(t, PackedWeight):
        raise ValueError(f"{name}: tensor parallelism slices dense tensors (load the GGUF expanded)")
    return t
