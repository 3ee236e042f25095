"""Cut a model down to one worker's part: a pipeline stage and a tensor-parallel slice.

Workers apply it to the model on the meta device, before any weight is read, to get the
part's shapes; models/rank_slice.py then cuts each tensor as it is read. On a loaded model
it makes fresh contiguous copies of the slices (the reference the sliced load is tested
against).
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.models.linear import Linear
from cadenza.models.llama import Attention, LlamaForCausalLM
from cadenza.models.moe import SparseMoE
from cadenza.models.partition import (
    expert_slice,
    stage_layers,  # noqa: F401 - this module's API
)
from cadenza.models.tp import TPGroup, head_slice, padded_vocab_slice, split_evenly


def shard_model(
    model: LlamaForCausalLM, tp: TPGroup, stage: int, num_stages: int, expert_parallel: bool = False
) -> LlamaForCausalLM:
    start, end = stage_layers(model.cfg.num_layers, num_stages, stage)
    model.layers = nn.ModuleList(list(model.layers)[start:end])
    model.is_first_stage, model.is_last_stage = stage == 0, stage == num_stages - 1
    if not model.is_first_stage:
        model.embed_tokens = nn.Embedding(1, 1).to(model.norm)  # placeholders: a later stage never embeds
    if not model.is_last_stage:
        model.lm_head = Linear(1, 1, bias=False).to(model.norm)
    if tp.size > 1:
        _shard_tensor_parallel(model, tp, expert_parallel)
    return model


def _keep(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> nn.Parameter:
    """A new parameter holding the given [start, end) ranges of t along dim, concatenated."""
    parts = [t.narrow(dim, s, e - s) for s, e in ranges]
    return nn.Parameter(torch.cat(parts, dim=dim).contiguous(), requires_grad=False)


def _shard_tensor_parallel(model: LlamaForCausalLM, tp: TPGroup, expert_parallel: bool) -> None:
    cfg = model.cfg
    heads = head_slice(cfg, tp.size, tp.rank)
    d = cfg.head_dim
    q = (heads.q_start * d, heads.q_end * d)
    k = (cfg.q_size + heads.kv_start * d, cfg.q_size + heads.kv_end * d)
    v = (k[0] + cfg.kv_size, k[1] + cfg.kv_size)
    ff = split_evenly(cfg.intermediate_size, tp.size, tp.rank)
    gate_up = [ff, (ff[0] + cfg.intermediate_size, ff[1] + cfg.intermediate_size)]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _column(attn.qkv_proj, [q, k, v])
        _row(attn.o_proj, q, tp)
        _set_heads(attn, heads.q_end - heads.q_start, heads.kv_end - heads.kv_start)
        if isinstance(mlp, SparseMoE):
            _shard_experts(mlp, tp, expert_parallel)
        else:
            _column(mlp.gate_up_proj, gate_up)
            _row(mlp.down_proj, ff, tp)
    model.tp = tp
    start, end = padded_vocab_slice(cfg.vocab_size, tp.size, tp.rank)
    if model.is_first_stage:
        model.vocab_start = start
        model.embed_tokens.weight = _keep(_pad_rows(model.embed_tokens.weight, end), 0, [(start, end)])
        model.embed_tokens.num_embeddings = end - start
    if model.is_last_stage:
        model.lm_head.weight_t = _keep(_pad_rows(model.lm_head.weight_t.t(), end).t(), 1, [(start, end)])


def _shard_experts(moe: SparseMoE, tp: TPGroup, expert_parallel: bool) -> None:
    """Expert parallelism: this rank's run of whole experts; else every expert's I split as a
    dense MLP's is. Either way the partial outputs are summed by the layer's one all-reduce."""
    inter, hidden = moe.intermediate, moe.hidden_size
    if expert_parallel:
        first, end = expert_slice(moe.num_experts, tp.size, tp.rank)
        moe.gate_up_proj.weight_t = _keep(moe.gate_up_proj.weight_t, 1, [(first * 2 * inter, end * 2 * inter)])
        moe.down_proj.weight_t = _keep(moe.down_proj.weight_t, 1, [(first * hidden, end * hidden)])
        moe.first_expert, moe.local_experts = first, end - first
    else:
        start, end = split_evenly(inter, tp.size, tp.rank)
        rows = [(e * 2 * inter + half * inter + start, e * 2 * inter + half * inter + end)
                for e in range(moe.num_experts) for half in (0, 1)]  # fmt: skip
        moe.gate_up_proj.weight_t = _keep(moe.gate_up_proj.weight_t, 1, rows)
        moe.down_proj.weight_t = _keep(moe.down_proj.weight_t, 0, [(start, end)])
        moe.intermediate = end - start
    moe.reduce = tp


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows up to `rows` (vocab padding: padded logits are sliced off after the gather)."""
    return w if w.shape[0] >= rows else torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])


def _column(linear: Linear, ranges: list[tuple[int, int]]) -> None:
    linear.weight_t = _keep(linear.weight_t, 1, ranges)
    if linear.bias is not None:
        linear.bias = _keep(linear.bias, 0, ranges)


def _row(linear: Linear, rows: tuple[int, int], tp: TPGroup) -> None:
    linear.weight_t = _keep(linear.weight_t, 0, [rows])
    linear.reduce = tp
    if linear.bias is not None and tp.rank:  # added once, by rank 0, before the all-reduce
        linear.bias = None


def _set_heads(attn: Attention, num_heads: int, num_kv_heads: int) -> None:
    attn.num_heads, attn.num_kv_heads = num_heads, num_kv_heads
    attn.q_size, attn.kv_size = num_heads * attn.head_dim, num_kv_heads * attn.head_dim
