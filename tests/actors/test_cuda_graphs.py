"""CUDA-graph bookkeeping (actors/cuda_graphs.py) through a stand-in capture on the CPU: the
ladder, padding to the next size, which size replays a batch, and outputs sliced back."""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.graph_capture import stand_in_capture

from cadenza.actors.cuda_graphs import DecodeGraphs, capture_sizes, graph_size

NUM_SLOTS, PAD_SLOT, PAD_BLOCK, MAX_BLOCKS = 64, 63, 7, 4


class ToyStep:
    """A decode step's shape: writes each row's "K" at its slot, and answers a value per row
    that depends on every input, so a wrong copy or stale padding shows."""

    def __init__(self) -> None:
        self.kv = torch.zeros(NUM_SLOTS, dtype=torch.int64)

    def __call__(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        self.kv.index_copy_(0, x["slot_mapping"], x["input_ids"] + 1000)
        return x["input_ids"] * 10_000 + x["positions"] * 100 + x["seq_lens"] + x["block_tables"].sum(1) * 7


def _batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS - 1, generator=g)[:rows]  # never the pad slot
    return {
        "input_ids": torch.randint(1, 500, (rows,), generator=g),
        "positions": torch.randint(0, 60, (rows,), generator=g),
        "slot_mapping": slots,
        "seq_lens": torch.randint(1, 60, (rows,), generator=g),
        "block_tables": torch.randint(0, PAD_BLOCK, (rows, 3), generator=g),  # narrower than MAX_BLOCKS
    }


def _eager(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    step = ToyStep()
    wide = dict(batch)
    pad = torch.full((batch["block_tables"].shape[0], MAX_BLOCKS - batch["block_tables"].shape[1]), PAD_BLOCK)
    wide["block_tables"] = torch.cat([batch["block_tables"], pad], 1)
    return step(wide), step.kv


def test_the_ladder_and_which_size_holds_a_batch() -> None:
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(5) == [1, 2, 4, 5] and capture_sizes(8) == [1, 2, 4, 8] and capture_sizes(1) == [1]
    ladder = capture_sizes(20)
    assert [graph_size(n, ladder) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert graph_size(21, ladder) is None  # larger than every graph: eager


@pytest.mark.parametrize("rows", [1, 3, 6, 11, 16])
def test_a_padded_replay_equals_the_eager_step_and_writes_only_the_pad_slot(rows: int) -> None:
    step = ToyStep()
    graphs = DecodeGraphs(capture_sizes(16), MAX_BLOCKS, PAD_SLOT, PAD_BLOCK, torch.device("cpu"))
    graphs.capture_all(step, stand_in_capture)
    step.kv.zero_()
    batch = _batch(rows, seed=rows)
    out = graphs.run(batch)
    expected, expected_kv = _eager(batch)
    assert out.shape == (rows,) and torch.equal(out, expected)
    size = graph_size(rows, graphs.ladder)
    assert graphs.replays[size] == 1 and sum(graphs.replays.values()) == 1
    real = step.kv.clone()
    real[PAD_SLOT] = 0  # padding rows (if any) wrote token 0 there, and nowhere else
    assert torch.equal(real, expected_kv)
    assert step.kv[PAD_SLOT] == (1000 if size > rows else 0)


def test_padding_rows_do_not_keep_a_previous_batchs_values() -> None:
    step = ToyStep()
    graphs = DecodeGraphs(capture_sizes(8), MAX_BLOCKS, PAD_SLOT, PAD_BLOCK, torch.device("cpu"))
    graphs.capture_all(step, stand_in_capture)
    graphs.run(_batch(8, seed=1))
    second = _batch(5, seed=2)
    assert torch.equal(graphs.run(second), _eager(second)[0])
    assert torch.equal(graphs.static["input_ids"][5:], torch.zeros(3, dtype=torch.int64))
    assert torch.equal(graphs.static["slot_mapping"][5:], torch.full((3,), PAD_SLOT))
    assert graphs.replays == {1: 0, 2: 0, 4: 0, 8: 2}


def test_a_batch_past_the_ladder_or_before_capture_runs_eagerly() -> None:
    graphs = DecodeGraphs(capture_sizes(4), MAX_BLOCKS, PAD_SLOT, PAD_BLOCK, torch.device("cpu"))
    assert graphs.run(_batch(2, seed=0)) is None  # nothing captured yet
    graphs.capture_all(ToyStep(), stand_in_capture)
    assert graphs.run(_batch(5, seed=0)) is None
    assert graphs.run(_batch(2, seed=0)) is not None
