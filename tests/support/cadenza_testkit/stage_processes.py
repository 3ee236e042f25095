"""One pipeline stage's process for tests/actors/test_stage_link.py. It lives here, not in the
test module, because torch's spawn pickles the function by module name and the child can
import `cadenza_testkit` (on PYTHONPATH) but not a test file loaded in importlib mode."""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from cadenza.actors.stage_link import StageLink
from cadenza.messages import HiddenStates

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _steps(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 8, generator=g).to(dtype), torch.randn(n, 8, generator=g).to(dtype)) for n in (5, 1, 3)]


def run_stage(rank: int, url: str) -> None:
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    link = StageLink.for_rank(0, rank, 1, 2)
    try:
        for dtype in DTYPES:
            for x, residual in _steps(dtype):
                if rank == 0:
                    message = link.send(x, residual)  # returns at once: the receiver is not there yet
                    # What the executor carries from stage to stage, as msgpack.
                    dist.broadcast_object_list([msgspec.msgpack.encode(message)], src=0)
                else:
                    box = [None]
                    dist.broadcast_object_list(box, src=0)
                    message = msgspec.msgpack.decode(box[0], type=HiddenStates)
                    got_x, got_residual = link.recv(message, torch.device("cpu"))
                    assert got_x.dtype == dtype and torch.equal(got_x, x) and torch.equal(got_residual, residual)
        link.flush()
    finally:
        dist.destroy_process_group()
