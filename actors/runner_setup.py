"""From a loaded model to its ModelRunner, the same in a worker and in the in-process engine:
how many KV blocks this rank can hold, then the runner over that pool (with its proposer and,
on CUDA, its decode graphs)."""

from __future__ import annotations

import sys

import torch

from cadenza.actors.cuda_graphs import graph_settings
from cadenza.actors.memory_profile import CudaProbe, MemoryProbe, kv_blocks_for_memory
from cadenza.actors.model_runner import ModelRunner
from cadenza.actors.proposers import build_proposer
from cadenza.actors.stage_link import StageLink
from cadenza.config import EngineConfig
from cadenza.kernels import ops
from cadenza.models.loader import LoadedModel


def kv_pool_blocks(config: EngineConfig, loaded: LoadedModel, planned: int, probe: MemoryProbe | None = None) -> int:
    """num_blocks when given; off CUDA the engine's plan (model, max_num_seqs, max_model_len,
    kv_cache_memory); on CUDA what gpu_memory_utilization leaves after a profiled step. A
    probe stands in for the device's memory in tests."""
    device = loaded.model.norm.device
    if config.num_blocks is not None or (device.type != "cuda" and probe is None):
        return planned
    return kv_blocks_for_memory(
        loaded.model,
        config.gpu_memory_utilization,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        config.block_size,
        probe or CudaProbe(device),
    )


def build_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    num_blocks: int,
    eos: tuple[int, ...],
    is_driver: bool = True,
    link: StageLink | None = None,
) -> ModelRunner:
    model = loaded.model
    # The driver samples, so it verifies drafts and proposes the next ones (a draft model runs
    # whole beside the target's last stage, sharing its block tables).
    share = kv_place(model.norm.device) if config.shares_kv else None
    proposer = build_proposer(config, loaded.config, loaded.max_model_len, num_blocks, share) if is_driver else None
    device = model.norm.device
    single_stage = model.is_first_stage and model.is_last_stage
    # Windowed and soft-capped attention runs a per-request torch path with host work in
    # it (kernels/attention/windowed.py): no graph can capture it.
    cfg = loaded.config
    eager = config.enforce_eager or cfg.sliding_window is not None or cfg.attn_softcap is not None
    graphs = graph_settings(eager, device, single_stage, ops.backend(device), config.max_num_seqs, loaded.max_model_len)
    return ModelRunner(
        model, num_blocks, config.block_size, eos, is_driver, proposer, lambda: loaded.tokenizer, graphs, link,
        samples_ahead=config.schedules_ahead, grammar_mask_timeout_s=config.grammar_mask_timeout_s,
        kv_share_place=share,
    )  # fmt: skip


def kv_place(device: torch.device) -> str:
    """Where a KV cache on `device` in this process can be opened by another process (the `ipc`
    KV transport): this Ray node ("local" outside Ray) and, on CUDA, this GPU by its UUID. A
    process opens CUDA IPC memory only on a GPU it sees, and Ray shows each worker its own,
    so a pull between GPUs goes through the object store instead."""
    # Ray is looked up, not imported: a process that never imported it runs outside Ray, and the
    # in-process engine (`LLM`, the GPU check) runs on hosts without Ray.
    ray = sys.modules.get("ray")
    node = ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else "local"
    return f"{node}/gpu-{torch.cuda.get_device_properties(device).uuid}" if device.type == "cuda" else node


def node_of(place: str) -> str:
    """The node part of a kv_place: processes there share one monotonic clock."""
    return place.split("/", 1)[0]
