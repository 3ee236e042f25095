"""Top-k routing and the expert-sorted order both expert paths run tokens in."""

from __future__ import annotations

import torch


def route_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]).

    Softmax over every expert in fp32, then the k best; with renormalize (Mixtral,
    Qwen3-MoE's norm_topk_prob) the chosen weights are scaled to sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, counts): the flattened (token, slot) pairs t * k + j ordered by expert (stable,
    so each expert's rows keep token order) and how many pairs each expert got."""
    flat = ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)
