"""AttentionMetadata: how a flattened (varlen) batch maps onto the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecodePlan:
    """Which query tokens run as one-query rows (decodes and short extends), built once a step
    by the CPU attention path and shared by every layer."""

    index: torch.Tensor | None  # [rows] token index into q; None: every token, in order
    block_tables: torch.Tensor  # [rows, max_blocks] each row's request's table
    seq_lens: torch.Tensor  # [rows] int64: keys each row sees (causal within an extend)
    long: list[int]  # requests whose extends run as their own causal attention


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer.

    Requests are ordered decodes first: the first `num_decodes` requests have exactly one
    query token, so decode attention runs as one batched op over them.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) per token
    query_start_loc: list[int]  # [num_reqs + 1]: request i's tokens are [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [num_reqs]: context length after this step's tokens
    seq_lens_tensor: torch.Tensor  # [num_reqs] int64, same values on the device
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with 0
    num_decodes: int
    # query_start_loc on the device, built by the Triton attention path on first use and then
    # shared by every layer of the step (one host-to-device copy per step, not per layer).
    query_start_loc_tensor: torch.Tensor | None = None
    decode_plan: DecodePlan | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)
