"""Pipeline stages hand hidden states over torch.distributed (actors/stage_link.py): two gloo
processes, stage 0 posts its sends and returns, stage 1 receives the same bits, in any dtype,
step after step; the message through the executor names only shape and dtype."""

from __future__ import annotations

import socket

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cadenza.actors.stage_link import StageLink
from cadenza.messages import HiddenStates

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _steps(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 8, generator=g).to(dtype), torch.randn(n, 8, generator=g).to(dtype)) for n in (5, 1, 3)]


def _stage(rank: int, url: str) -> None:
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


def test_hidden_states_cross_between_stages_in_every_dtype() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(_stage, args=(url,), nprocs=2, join=True)


def test_the_links_of_a_tp2_pp3_grid() -> None:
    links = {(t, p): StageLink.for_rank(t, p, 2, 3) for t in range(2) for p in range(3)}
    assert (links[0, 0].prev_rank, links[0, 0].next_rank) == (None, 2)
    assert (links[1, 1].prev_rank, links[1, 1].next_rank) == (1, 5)
    assert (links[1, 2].prev_rank, links[1, 2].next_rank) == (3, None)
    assert StageLink.for_rank(0, 0, 4, 1) is None  # no stages, no link
    assert msgspec.structs.fields(HiddenStates)[-1].name == "dtype"  # no tensor bytes in the message
