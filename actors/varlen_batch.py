"""Flattened (varlen) batch inputs: token ids, positions and attention metadata for a list of
per-request chunks. Shared by the target model runner and the draft model proposer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadenza.actors.device_copy import to_device
from cadenza.kernels.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class Chunk:
    """The next tokens of one request to compute, from position `start`, through its block table."""

    token_ids: list[int]
    start: int
    block_ids: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def build_batch(
    chunks: list[Chunk], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata). Callers put one-token chunks first: attention runs
    those leading decodes as one batched op."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl, seq_lens = [0], []
    for c in chunks:
        ids += c.token_ids
        positions += range(c.start, c.end)
        slots += [c.block_ids[p // block_size] * block_size + p % block_size for p in range(c.start, c.end)]
        qsl.append(len(ids))
        seq_lens.append(c.end)
    num_decodes = next((i for i, c in enumerate(chunks) if len(c.token_ids) != 1), len(chunks))
    width = max(len(c.block_ids) for c in chunks)
    tables = [c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks]
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, torch.long, device),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        seq_lens_tensor=to_device(seq_lens, torch.long, device),
        block_tables=to_device(tables, torch.long, device),
        num_decodes=num_decodes,
    )
    return to_device(ids, torch.long, device), to_device(positions, torch.long, device), meta
