"""The KV pool on a GPU: as many blocks as `gpu_memory_utilization` of the device leaves once
the weights and the largest step's activations are counted, measured by a profiling forward
(as vLLM sizes its pool).

The profiling step is the largest a step can be: max_num_batched_tokens tokens, cut into
requests of one block each that all write one scratch block (so it needs no pool yet), and
the logits and softmax of max_num_seqs sampled rows. Its peak above the weights is the
activation memory every later step fits in. Then, with the allocator's cache emptied:

    kv bytes = utilization * total - (total - free) - activation peak

where total - free is everything the device holds now (weights, the CUDA context, other
processes). That is divided by this rank's bytes per block (its stage's layers, its KV
heads). The memory a probe reads is behind `MemoryProbe`, so the arithmetic and the
profiling step are tested on the CPU with a stand-in.

Not counted: a draft model (speculation with `method: draft`) is loaded after the profile,
so its weights and KV come out of the same budget; lower the utilization to make room.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cadenza.actors.kv_tensors import allocate_kv_cache
from cadenza.actors.varlen_batch import Chunk, build_batch
from cadenza.models.llama import LlamaForCausalLM


class MemoryProbe(Protocol):
    def reset_peak(self) -> None: ...

    def allocated(self) -> int: ...  # bytes the allocator hands out now

    def peak(self) -> int: ...  # the most it handed out since reset_peak

    def free_and_total(self) -> tuple[int, int]: ...  # the device's, with the cache emptied


class CudaProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def free_and_total(self) -> tuple[int, int]:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)


def kv_block_bytes(model: LlamaForCausalLM, block_size: int) -> int:
    """K and V of one block over this rank's layers and KV heads."""
    itemsize = model.weight_format.cache_dtype(model.norm.dtype).itemsize
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * itemsize for a in (ly.self_attn for ly in model.layers))


def profile_step(model: LlamaForCausalLM, num_tokens: int, num_rows: int, block_size: int) -> None:
    """The largest step's forward, on dummy tokens (see the module's docstring)."""
    scratch = allocate_kv_cache(model, 1, block_size)
    sizes = [block_size] * (num_tokens // block_size) + ([num_tokens % block_size] if num_tokens % block_size else [])
    chunks = [Chunk([0] * n, 0, [0]) for n in sizes]
    ids, positions, meta = build_batch(chunks, block_size, model.norm.device)
    with torch.inference_mode():
        if model.is_first_stage:
            x = model.embed(ids)
        else:  # a later pipeline stage starts from hidden states: zeros of their shape do
            x = torch.zeros(num_tokens, model.cfg.hidden_size, dtype=model.norm.dtype, device=model.norm.device)
        x, residual = model.run_layers(x, None, positions, scratch, meta)
        if model.is_last_stage:
            logits = model.compute_logits(model.final_norm(x, residual)[: min(num_rows, num_tokens)])
            torch.sort(torch.softmax(logits, -1), -1, descending=True)  # top-p's sort, the sampler's largest


def kv_blocks_for_memory(
    model: LlamaForCausalLM, utilization: float, num_tokens: int, num_rows: int, block_size: int, probe: MemoryProbe
) -> int:
    """How many KV blocks fit (see the module's docstring); a clear error when none does."""
    probe.reset_peak()
    before = probe.allocated()
    profile_step(model, num_tokens, num_rows, block_size)
    activations = probe.peak() - before
    free, total = probe.free_and_total()
    budget = int(utilization * total) - (total - free) - activations
    blocks = budget // kv_block_bytes(model, block_size)
    if blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization {utilization} of {total / gib:.1f} GiB, with "
            f"{(total - free) / gib:.2f} GiB in use and {activations / gib:.2f} GiB for a step's activations; raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens"
        )
    return blocks
