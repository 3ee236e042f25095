"""CUDA graphs for decode: the bookkeeping (which sizes are captured, how a batch is padded to
one, which graph replays it, how its outputs are sliced back), apart from the capture itself.

A small model's decode step on a GPU is bound by kernel launches, not by bytes: a graph
replays the whole step's launches as one. A graph has fixed shapes and fixed addresses, so:
- it is captured once per batch size of a ladder (1, 2, 4, 8, then every 8 up to
  max_num_seqs, as vLLM does), and a batch of n decodes replays the smallest size >= n;
- its inputs live in static buffers sized for the largest graph; a step copies its rows in,
  and the rows past n are padding: token 0 at position 0, writing its K/V to a scratch slot
  no request owns (`pad_slot`) and attending to one token of it (a seq_len of 1, block 0 of
  the scratch), so padding computes garbage that nobody reads and harms nothing;
- the outputs are sliced back to the first n rows.
Prefill and extend steps, and batches larger than the ladder, run eagerly.

`capture` turns a step function over the static buffers into a replayable callable. On CUDA
it is `cuda_capture` (torch.cuda.CUDAGraph, warmed up on a side stream first); tests pass a
stand-in that runs on the CPU, so everything but the capture is tested without a GPU.

The ModelRunner captures its decode step (embed, layers, final norm, logits) when
`graph_settings` says to: CUDA, the Triton kernels, one pipeline stage (a stage that hands
hidden states on leaves through the host), and not `enforce_eager`. The captured step reads
only tensors: its attention metadata carries the static seq_lens and block tables, and the
host-side "max context" that sizes the split-KV grid is max_model_len, so a graph fits every
context (partitions past a row's length are empty and weigh nothing in the merge). Sampling
runs eagerly on the graph's logits. A step is graphed when every token it computes is
sampled: decodes, and speculative verification, whose k + 1 tokens a request become k + 1
one-query rows (each with its own position's context and its request's block table), so a
verify step of b requests is a graph of b(k + 1) rows. Prompt chunks run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

StepFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]
Capture = Callable[[StepFn, dict[str, torch.Tensor]], Callable[[], torch.Tensor]]
# The per-request inputs of a decode step, each [rows, ...]; every one is padded.
INPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")


@dataclass(frozen=True, slots=True)
class GraphSettings:
    """What a runner needs to capture its decode graphs."""

    max_num_seqs: int  # the ladder's top
    max_model_len: int  # static block tables hold this many tokens; the split-KV grid's ceiling
    capture: Capture


def graph_settings(
    enforce_eager: bool, device: torch.device, single_stage: bool, kernels: str, max_num_seqs: int, max_model_len: int
) -> GraphSettings | None:
    """Graphs where they can run: on CUDA with the Triton kernels (the torch reference syncs
    on the host inside a step), with one pipeline stage, unless enforce_eager."""
    if enforce_eager or device.type != "cuda" or not single_stage or kernels != "triton":
        return None
    return GraphSettings(max_num_seqs, max_model_len, cuda_capture)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The ladder: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (which is always a rung)."""
    ladder = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return ladder + [max_num_seqs]


def graph_size(num_rows: int, ladder: list[int]) -> int | None:
    """The smallest captured size that holds num_rows decodes; None: run eagerly."""
    return next((size for size in ladder if size >= num_rows), None)


class DecodeGraphs:
    """One graph per ladder size over shared static inputs (the largest size's buffers)."""

    def __init__(self, ladder: list[int], max_blocks: int, pad_slot: int, pad_block: int, device: torch.device) -> None:
        self.ladder, self.pad_slot, self.pad_block = ladder, pad_slot, pad_block
        rows, i64 = ladder[-1], dict(dtype=torch.int64, device=device)
        self.static = {
            "input_ids": torch.zeros(rows, **i64),
            "positions": torch.zeros(rows, **i64),
            "slot_mapping": torch.full((rows,), pad_slot, **i64),
            "seq_lens": torch.ones(rows, **i64),
            "block_tables": torch.full((rows, max_blocks), pad_block, **i64),
        }
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays: dict[int, int] = dict.fromkeys(ladder, 0)  # graph size -> steps it ran

    def capture_all(self, step: StepFn, capture: Capture) -> None:
        """A graph per size, largest first (so the memory pool the first one takes fits the rest)."""
        for size in sorted(self.ladder, reverse=True):
            view = {name: buffer[:size] for name, buffer in self.static.items()}
            self.graphs[size] = capture(step, view)

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The step's output for these decode rows by replaying a graph, or None when no graph
        holds them (the caller runs the step eagerly)."""
        rows = inputs["input_ids"].shape[0]
        size = graph_size(rows, self.ladder)
        too_wide = inputs["block_tables"].shape[1] > self.static["block_tables"].shape[1]
        if size is None or size not in self.graphs or too_wide:
            return None
        self._fill(inputs, rows, size)
        self.replays[size] += 1
        return self.graphs[size]()[:rows]

    def _fill(self, inputs: dict[str, torch.Tensor], rows: int, size: int) -> None:
        """Copy the real rows in and reset the padding rows [rows, size) to the harmless values."""
        for name in INPUTS:
            static, given = self.static[name], inputs[name]
            if name == "block_tables":
                static[:rows, : given.shape[1]].copy_(given)
                static[:rows, given.shape[1] :].fill_(self.pad_block)
            else:
                static[:rows].copy_(given)
        pad = {"input_ids": 0, "positions": 0, "slot_mapping": self.pad_slot, "seq_lens": 1}
        for name, value in pad.items():
            self.static[name][rows:size].fill_(value)
        self.static["block_tables"][rows:size].fill_(self.pad_block)


def cuda_capture(step: StepFn, inputs: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Capture `step` over `inputs` as a CUDA graph; the callable replays it and returns its
    (static) output. Warm-up runs on a side stream first, as torch's docs ask."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step(inputs)

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay
