"""Pipeline stages hand hidden states over torch.distributed (actors/stage_link.py): two gloo
processes, stage 0 posts its sends and returns, stage 1 receives the same bits, in any dtype,
step after step; the message through the executor names only shape and dtype."""

from __future__ import annotations

import socket

import msgspec
import torch.multiprocessing as mp
from cadenza_testkit.stage_processes import run_stage

from cadenza.actors.stage_link import StageLink
from cadenza.messages import HiddenStates


def test_hidden_states_cross_between_stages_in_every_dtype() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(run_stage, args=(url,), nprocs=2, join=True)


def test_the_links_of_a_tp2_pp3_grid() -> None:
    links = {(t, p): StageLink.for_rank(t, p, 2, 3) for t in range(2) for p in range(3)}
    assert (links[0, 0].prev_rank, links[0, 0].next_rank) == (None, 2)
    assert (links[1, 1].prev_rank, links[1, 1].next_rank) == (1, 5)
    assert (links[1, 2].prev_rank, links[1, 2].next_rank) == (3, None)
    assert StageLink.for_rank(0, 0, 4, 1) is None  # no stages, no link
    assert msgspec.structs.fields(HiddenStates)[-1].name == "dtype"  # no tensor bytes in the message
