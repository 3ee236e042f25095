"""The runner's decode step as CUDA graphs (cuda_graphs.py holds the ladder, padding and
replay bookkeeping): capturing the model's step over static inputs, and replaying a batch
whose every computed token is sampled."""

from __future__ import annotations

import torch

from cadenza.actors.cuda_graphs import DecodeGraphs, GraphSettings, StepFn, capture_sizes
from cadenza.actors.device_copy import to_device
from cadenza.actors.input_batch import Batch
from cadenza.kernels.attention.metadata import AttentionMetadata, DecodePlan
from cadenza.models.llama import LlamaForCausalLM

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def capture_decode_graphs(
    model: LlamaForCausalLM, kv_caches: KVCaches, settings: GraphSettings, num_blocks: int, block_size: int
) -> DecodeGraphs:
    """Graphs over a pool of num_blocks whose kv_caches hold one more block: the padding rows'
    scratch, which no request owns."""
    max_blocks = -(-settings.max_model_len // block_size)
    pad_slot = num_blocks * block_size  # slot 0 of the scratch block
    ladder = capture_sizes(settings.max_num_seqs)
    graphs = DecodeGraphs(ladder, max_blocks, pad_slot, num_blocks, model.norm.device)
    with torch.inference_mode():
        graphs.capture_all(decode_step(model, kv_caches, settings.max_model_len), settings.capture)
    return graphs


def decode_step(model: LlamaForCausalLM, kv_caches: KVCaches, max_model_len: int) -> StepFn:
    """A decode step over static inputs, reading no host value that changes between steps:
    the logits of every row."""

    def step(x: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = x["input_ids"].shape[0]
        tables, lens = x["block_tables"], x["seq_lens"]
        # Host lists only for shapes: every row one query token, contexts up to max_model_len.
        meta = AttentionMetadata(
            x["slot_mapping"], list(range(rows + 1)), [max_model_len] * rows, lens, tables, rows,
            decode_plan=DecodePlan(None, tables, lens, []),
        )  # fmt: skip
        h, residual = model.run_layers(model.embed(x["input_ids"]), None, x["positions"], kv_caches, meta)
        return model.compute_logits(model.final_norm(h, residual))

    return step


def replay(graphs: DecodeGraphs, batch: Batch) -> torch.Tensor | None:
    """The logits of a step from a graph when every token it computes is sampled: decodes,
    and speculative verification (a request's k + 1 tokens are k + 1 one-query rows, each
    seeing the keys up to its own position). None: run it eagerly (a prompt chunk, or no
    graph holds that many rows)."""
    num_tokens = batch.input_ids.shape[0]
    if len(batch.sample_rows) != num_tokens:
        return None
    meta = batch.meta
    tables = meta.block_tables
    if num_tokens != meta.num_reqs:  # verification: each token's row takes its request's table
        qsl = meta.query_start_loc
        per_request = to_device([qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)], torch.long, tables.device)
        tables = tables.repeat_interleave(per_request, dim=0)
    inputs = {
        "input_ids": batch.input_ids,
        "positions": batch.positions,
        "slot_mapping": meta.slot_mapping,
        "seq_lens": batch.positions + 1,  # causal: the keys up to and including its own
        "block_tables": tables,
    }
    return graphs.run(inputs)
