"""Sizing the KV pool from gpu_memory_utilization (actors/memory_profile.py) on the CPU: the
profiling step runs the largest step's shapes for real, a stand-in probe plays the device's
memory, and the pool is what the arithmetic leaves."""

from __future__ import annotations

import pytest
import torch

from cadenza.actors.memory_profile import kv_block_bytes, kv_blocks_for_memory
from cadenza.actors.runner_setup import kv_pool_blocks
from cadenza.config import EngineConfig
from cadenza.models.loader import load_model

GIB = 1 << 30


class StandInProbe:
    """A 10 GiB device with 4 GiB in use, where the profiled step peaks `activations` above
    what was allocated before it."""

    def __init__(self, activations: int, in_use: int = 4 * GIB) -> None:
        self.activations, self.in_use, self.resets = activations, in_use, 0

    def reset_peak(self) -> None:
        self.resets += 1

    def allocated(self) -> int:
        return 3 * GIB

    def peak(self) -> int:
        return 3 * GIB + self.activations

    def free_and_total(self) -> tuple[int, int]:
        return 10 * GIB - self.in_use, 10 * GIB


@pytest.fixture
def loaded(tiny_model):  # noqa: ANN201 - a LoadedModel
    path, _ = tiny_model("llama_gqa_tied")
    return load_model(str(path), EngineConfig(model=str(path)).weight_format, "cpu")


def test_the_pool_is_what_utilization_leaves_after_use_and_activations(loaded, monkeypatch) -> None:
    shapes: list[tuple[int, ...]] = []
    run_layers = loaded.model.run_layers
    monkeypatch.setattr(loaded.model, "run_layers", lambda x, *a: shapes.append(tuple(x.shape)) or run_layers(x, *a))
    probe = StandInProbe(activations=GIB)
    blocks = kv_blocks_for_memory(loaded.model, 0.9, 300, 8, 16, probe)
    per_block = kv_block_bytes(loaded.model, 16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V x layers x block x kv heads x head_dim x fp32
    assert blocks == (int(0.9 * 10 * GIB) - 4 * GIB - GIB) // per_block
    assert shapes == [(300, 64)] and probe.resets == 1  # the whole token budget in one step


def test_no_room_is_a_clear_error(loaded) -> None:
    with pytest.raises(ValueError, match="no room for the KV cache: gpu_memory_utilization 0.5"):
        kv_blocks_for_memory(loaded.model, 0.5, 64, 4, 16, StandInProbe(activations=2 * GIB))


def test_num_blocks_overrides_the_profile_and_the_cpu_keeps_its_plan(loaded) -> None:
    config = EngineConfig(model="m", max_num_batched_tokens=64)
    assert kv_pool_blocks(config, loaded, planned=123) == 123  # CPU: no profile
    profiled = kv_pool_blocks(config, loaded, planned=123, probe=StandInProbe(activations=0))
    assert profiled == (int(0.9 * 10 * GIB) - 4 * GIB) // kv_block_bytes(loaded.model, 16)
    given = EngineConfig(model="m", num_blocks=7)  # the engine's plan is then 7, and no profile runs
    assert kv_pool_blocks(given, loaded, planned=7, probe=StandInProbe(activations=100 * GIB)) == 7


def test_the_profiling_step_fits_a_later_pipeline_stage(tiny_model) -> None:
    from cadenza.actors.memory_profile import profile_step
    from cadenza.models.tp import SINGLE
    from cadenza.models.weights import ModelPart

    path, _ = tiny_model("llama_gqa_tied")
    fmt = EngineConfig(model=str(path)).weight_format
    last = load_model(str(path), fmt, "cpu", None, ModelPart(SINGLE, 1, 2)).model
    assert not last.is_first_stage
    profile_step(last, 40, 4, 16)  # starts from zero hidden states, ends in the logits
    assert torch.isfinite(last.norm).all()
