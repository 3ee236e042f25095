"""Hidden states between pipeline stages over torch.distributed point-to-point (NCCL on CUDA,
gloo on the CPU), never through the engine or Ray's object store.

Stage s + 1's step is only started once stage s has returned (the executor chains the calls,
or the compiled graph's channel does), so stage s cannot block in a send its receiver has not
posted yet: it posts the send (isend), returns a HiddenStates that names the tensors' shape
and dtype, and waits for the send only before its next one, keeping the buffers alive until
then. Stage s + 1 receives first thing in its step. Bytes travel as uint8 views, so every
dtype (bf16 included) crosses gloo and NCCL alike. TP rank i of one stage feeds TP rank i of
the next (each stage's outputs are identical across its ranks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cadenza.messages import HiddenStates


class StageLink:
    def __init__(self, prev_rank: int | None, next_rank: int | None) -> None:
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    @classmethod
    def for_rank(cls, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int) -> StageLink | None:
        """The link of global rank pp_rank * tp_size + tp_rank; None without pipeline stages."""
        if pp_size == 1:
            return None
        rank = pp_rank * tp_size + tp_rank
        prev_rank = rank - tp_size if pp_rank > 0 else None
        return cls(prev_rank, rank + tp_size if pp_rank < pp_size - 1 else None)

    def send(self, x: torch.Tensor, residual: torch.Tensor) -> HiddenStates:
        self.flush()
        for t in (x, residual):
            raw = t.contiguous().view(torch.uint8)
            self._in_flight.append((dist.isend(raw, self.next_rank), raw))
        return HiddenStates(shape=list(x.shape), dtype=str(x.dtype).removeprefix("torch."))

    def recv(self, h: HiddenStates, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = getattr(torch, h.dtype)
        nbytes = math.prod(h.shape) * dtype.itemsize
        out = []
        for _ in range(2):
            raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.recv(raw, self.prev_rank)
            out.append(raw.view(dtype).view(h.shape))
        return out[0], out[1]

    def flush(self) -> None:
        """Wait for the sends still in flight (their receiver has taken them by now, or will)."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()
