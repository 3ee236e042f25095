"""Host values onto the device without waiting for it.

On CUDA, torch.tensor(values, device="cuda"), and indexing a CUDA tensor with a Python list
(its index tensor is built on the host and copied over), copy from pageable memory with a
blocking copy: the host waits until the GPU's queue drains. In a step prepared while the
previous one computes (async scheduling) each would stall the host behind that step. The
values go instead through pinned memory by a non-blocking copy; torch's pinned-memory
allocator keeps the buffer until the copy has run. On the CPU these are the plain calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), queued rather than waited for."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto device: on CUDA through pinned memory, queued; elsewhere as is."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def take_rows(x: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """x[rows] along dim 0: x itself when rows are all of its rows in order (a batch of
    decodes), else a gather by an index queued onto x's device."""
    if len(rows) == x.shape[0] and all(r == i for i, r in enumerate(rows)):
        return x
    return x.index_select(0, to_device(rows, torch.long, x.device))
