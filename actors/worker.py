"""Worker: one Ray actor per model shard. It owns the shard's weights, KV cache tensors, model
runner and sampler, and answers `execute(step)` with what its stage hands on (StageOutput).
Messages cross as msgpack (cadenza.actors.codec).

Plain class here; cadenza.actors.executor wraps it with ray.remote and its resources.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading

import numpy as np
import ray
import torch
import torch.distributed as dist

from cadenza.actors import codec
from cadenza.actors.device_samples import PendingOutput, landed
from cadenza.actors.draft_proposer import DraftModelProposer
from cadenza.actors.heap_trim import trim_heap
from cadenza.actors.kv_connector.blocks import KVCaches, gather_blocks, scatter_blocks
from cadenza.actors.kv_connector.handoff import KVShare
from cadenza.actors.kv_connector.nixl_transfer import NixlAgent
from cadenza.actors.kv_connector.shared_cache import PeerCaches, check_lease, pull_blocks
from cadenza.actors.local_ray import unnice_worker
from cadenza.actors.model_runner import ModelRunner
from cadenza.actors.runner_setup import build_runner, kv_place, kv_pool_blocks, node_of
from cadenza.actors.stage_link import StageLink
from cadenza.messages import HiddenStates, ModelRunnerOutput, SchedulerOutput, WorkerSpec
from cadenza.models.loader import LoadedModel, load_model
from cadenza.models.tp import SINGLE, TPGroup
from cadenza.models.weights import ModelPart
from cadenza.weight_format import WeightFormat

# What one worker hands on from a step: HiddenStates from a stage before the last (the next
# stage's input), the ModelRunnerOutput from the driver (the last stage's TP rank 0), and None
# from every other rank, whose output nobody reads.
StageOutput = ModelRunnerOutput | HiddenStates | None


log = logging.getLogger(__name__)


def _sliceable(fmt: WeightFormat, tp_size: int) -> WeightFormat:
    """Tensor parallelism slices dense weights (on-load int8 / int4 quantize each slice after):
    a GGUF's kept blocks are expanded to the dense dtype there, and the log says so."""
    if tp_size == 1 or not fmt.keep_gguf:
        return fmt
    log.warning("tensor_parallel_size=%d: GGUF blocks are expanded to %s to be sliced", tp_size, fmt.dtype)
    return dataclasses.replace(fmt, keep_gguf=False)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        codec.register()
        self.spec = spec
        unnice_worker()
        torch.set_num_threads(self.spec.num_threads)
        self.runner: ModelRunner | None = None
        self._loaded: LoadedModel | None = None
        self._kv_blocks, self._tp_rank = spec.num_blocks, 0
        self._peers: PeerCaches | None = None  # other engines' shared KV caches, opened on a first pull
        self._nixl: NixlAgent | None = None  # the `nixl` transport's agent, made on a first share or pull

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self, loopback: bool) -> str:
        """Where rank 0 hosts the torch.distributed rendezvous: loopback when every worker
        shares this node (nothing else listens beyond it), else this node's cluster address."""
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def load(self, dist_url: str | None) -> int:
        """Join the process group (with TP or PP), load and shard the model, and size
        the KV pool this rank can hold (kv_blocks); allocate() then builds the runner over the
        pool every rank agrees on. Returns the process id, so tests and operators can find
        (and kill) the worker."""
        spec, cfg = self.spec, self.spec.config
        torch.manual_seed(cfg.seed)
        # One process group for TP collectives and the stages' point-to-point hidden states.
        tp = self._join_group(dist_url) if cfg.world_size > 1 else SINGLE
        self._tp_rank = tp.rank
        device = "cuda" if cfg.device.startswith("cuda") else cfg.device
        # Only this rank's part of this stage is read into memory (models/rank_slice.py).
        part = ModelPart(tp, spec.pp_rank, cfg.pipeline_parallel_size, cfg.enable_expert_parallel)
        self._loaded = load_model(cfg.model, _sliceable(cfg.weight_format, tp.size), device, cfg.max_model_len, part)
        self._kv_blocks = kv_pool_blocks(cfg, self._loaded, spec.num_blocks)
        return os.getpid()

    def kv_blocks(self) -> int:
        """The KV blocks this rank has room for (its profile on CUDA, else the engine's plan)."""
        return self._kv_blocks

    def allocate(self, num_blocks: int) -> None:
        """The runner over a pool of num_blocks (the smallest any rank has room for)."""
        if self._loaded is None:
            raise RuntimeError("worker.allocate before worker.load")
        is_driver = self._tp_rank == 0 and self._loaded.model.is_last_stage
        eos = tuple(self.spec.eos_token_ids)
        cfg = self.spec.config
        tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        link = StageLink.for_rank(self._tp_rank, self.spec.pp_rank, tp, pp)
        self.runner = build_runner(cfg, self._loaded, num_blocks, eos, is_driver, link)
        trim_heap()  # the loader's dense and packed copies were freed: give their pages back

    def _join_group(self, dist_url: str) -> TPGroup:
        cfg, spec = self.spec.config, self.spec
        tp = cfg.tensor_parallel_size
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=dist_url,
            rank=spec.pp_rank * tp + spec.tp_rank,
            world_size=cfg.world_size,
            timeout=datetime.timedelta(seconds=cfg.distributed_timeout_s),
        )
        # Every process must create every group, in the same order.
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(cfg.pipeline_parallel_size)]
        return TPGroup(spec.tp_rank, tp, groups[spec.pp_rank])

    def execute(self, step: SchedulerOutput, previous: HiddenStates | None = None) -> StageOutput:
        """Run this shard's part of a step. A later stage gets the previous stage's output: None
        after an empty step (bookkeeping only), which carries no hidden states."""
        return landed(self.launch(step, previous))

    def launch(self, step: SchedulerOutput, previous: HiddenStates | None = None) -> StageOutput | PendingOutput:
        """execute(), but scheduling ahead the output may still be pending (in-process callers
        only: a PendingOutput holds device tensors, and crosses no actor boundary)."""
        if self.runner is None:
            raise RuntimeError("worker.execute before worker.load")
        result = self.runner.execute(step, previous if step.total_num_scheduled_tokens else None)
        if isinstance(result, ModelRunnerOutput) and not self.runner.is_driver:
            return None  # only the driver's output is read
        return result

    def _kv_sets(self) -> list[KVCaches]:
        """The caches a block's KV lives in on this shard: the model's and, on the driver, a
        draft model's (it shares the block ids: every cached block holds both)."""
        proposer = self.runner.proposer
        draft = [proposer.kv_caches] if isinstance(proposer, DraftModelProposer) else []
        return [self.runner.kv_caches, *draft]

    def read_kv(self, block_ids: list[int]) -> list[np.ndarray]:
        """These blocks' KV on this shard, an array per cache set (the KV connector's export;
        kv_connector/blocks.py)."""
        return [gather_blocks(caches, block_ids) for caches in self._kv_sets()]

    def write_kv(self, block_ids: list[int], data: list[np.ndarray], positions: list[int]) -> int:
        """Another engine's blocks `positions` of `data` (read_kv's arrays from the same shard
        there) into block_ids here; returns the bytes written."""
        sets = self._kv_sets()
        if len(data) != len(sets):
            raise ValueError(
                f"{len(data)} KV cache sets for this shard's {len(sets)}: a draft model's KV moves with the "
                "blocks, so both engines need the same speculative method"
            )
        pairs = zip(sets, data, strict=True)
        return sum(scatter_blocks(caches, block_ids, array, positions) for caches, array in pairs)

    def kv_shares(self) -> list[KVShare] | None:
        """How a peer opens this shard's cache sets (the `ipc` and `nixl` KV transports), or
        None where they are private."""
        sets = self._kv_sets()
        shares = [getattr(caches, "share", None) for caches in sets]
        if None in shares:
            return None
        return self._nixl_agent(sets).shares() if self.spec.config.kv_transport == "nixl" else shares

    def pull_kv(
        self, block_ids: list[int], shares: list[KVShare], source_ids: list[int], lease_end: tuple[float, float]
    ) -> int:
        """Another engine's blocks source_ids, copied straight out of its shared caches (the same
        shard there) into block_ids here, inside its lease (its end by the node's monotonic
        clock, and by the wall clock); returns the bytes."""
        sets = self._kv_sets()
        if len(shares) != len(sets):
            raise ValueError(f"{len(shares)} shared KV cache sets for this shard's {len(sets)}: see write_kv")
        place = kv_place(self.runner.device)
        # By NIXL where the exporter's agent is named and this engine chose NIXL, or the
        # caches are elsewhere (an `ipc` importer in the exporter's place maps them instead).
        if shares[0].nixl_agent and (self.spec.config.kv_transport == "nixl" or shares[0].place != place):
            done = self._nixl_agent(sets).pull(block_ids, shares, source_ids)
        else:
            self._peers = self._peers or PeerCaches(place)
            pairs = zip(sets, shares, strict=True)
            done = sum(pull_blocks(caches, block_ids, self._peers.tensor(s), source_ids) for caches, s in pairs)
        check_lease(*lease_end, same_node=node_of(shares[0].place) == node_of(place))
        return done

    def _nixl_agent(self, sets: list[KVCaches]) -> NixlAgent:
        """This shard's NIXL agent over its current cache sets (made anew for new ones)."""
        if (
            self._nixl is None
            or len(self._nixl.sets) != len(sets)
            or any(mine is not theirs for mine, theirs in zip(self._nixl.sets, sets))
        ):
            self._nixl = NixlAgent(sets)
        return self._nixl

    def weight_bytes(self) -> int:
        """Bytes of this shard's weights as stored (what a decode step streams)."""
        return self.runner.model.weight_bytes() if self.runner is not None else 0

    def ping(self) -> bool:
        return True

    def watch(self) -> None:
        """Never returns: the executor keeps one call pending in the "watch" concurrency group,
        so the worker's death fails that call at once, whatever the step's transport is doing."""
        threading.Event().wait()
