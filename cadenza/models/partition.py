"""How a model is cut over TP ranks (heads, vocabulary) and PP stages (layers), without
torch: clients check a layout before any worker exists."""

from __future__ import annotations

from dataclasses import dataclass

from cadenza.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """The heads one rank owns: query heads [q_start, q_end), KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items go to `parts` parts, sizes differing by <= 1."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def head_slice(cfg: ModelConfig, tp: int, rank: int) -> HeadSlice:
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    if cfg.num_kv_heads >= tp:
        kv_start, kv_end = split_evenly(cfg.num_kv_heads, tp, rank)
        return HeadSlice(kv_start * group, kv_end * group, kv_start, kv_end)
    if tp % cfg.num_kv_heads or group % (tp // cfg.num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split {cfg.num_heads} query heads over "
            f"{cfg.num_kv_heads} KV heads: when ranks outnumber KV heads, each KV head's "
            "query group must divide evenly among the ranks that share it"
        )
    ranks_per_kv = tp // cfg.num_kv_heads
    kv = rank // ranks_per_kv
    per_rank = group // ranks_per_kv
    q_start = kv * group + (rank % ranks_per_kv) * per_rank
    return HeadSlice(q_start, q_start + per_rank, kv, kv + 1)


def expert_slice(num_experts: int, ranks: int, rank: int) -> tuple[int, int]:
    """[first, end) of the whole experts a rank holds under expert parallelism."""
    if num_experts < ranks:
        raise ValueError(f"expert parallelism over {ranks} ranks needs at least as many experts, not {num_experts}")
    return split_evenly(num_experts, ranks, rank)


def padded_vocab_slice(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Equal-width vocab slices (the last padded), so logits all-gather in one collective."""
    width = -(-vocab // tp)
    return rank * width, (rank + 1) * width


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp > cfg.num_heads:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's {cfg.num_heads} attention heads")
    for rank in range(tp):
        head_slice(cfg, tp, rank)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers")
    return split_evenly(num_layers, num_stages, stage)
