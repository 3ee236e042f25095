"""The codec that carries messages between actors: every message type round-trips as msgpack,
and what Ray's envelope holds besides the msgpack is a reference to a decoder, never a pickle
of the message. No Ray instance needed: the Ray path itself runs in the actor tests."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import msgspec
import pytest
import ray.cloudpickle

from cadenza.actors import codec
from cadenza.config import EngineConfig
from cadenza.messages import (
    CachedRequestData,
    EngineOutput,
    EngineRequest,
    HiddenStates,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    Refusal,
    SchedulerOutput,
    TokenLogprobs,
    WorkerSpec,
)
from cadenza.sampling_params import SamplingParams
from cadenza.stats import BlockPoolStats, EngineStats, ServingStats

PARAMS = SamplingParams(temperature=0, max_tokens=4, stop=["x"])
CONFIG = EngineConfig(model="m", num_blocks=8, speculative_config={"method": "ngram"})
SAMPLES = [
    CONFIG,
    EngineRequest(request_id="a", prompt_token_ids=[1, 2], sampling_params=PARAMS, cache_salt="s"),
    Refusal("dead", "the engine loop stopped: EngineBroken: block tables and pool disagree"),
    OutputBatch(last=3, outputs=[EngineOutput(request_id="a", new_token_ids=[5], finish_reason="stop")]),
    ServingStats(
        engine=EngineStats(1, 0, 0, BlockPoolStats(8, 7, 0.1, 2, 1, 0)),
        num_workers=1,
        worker_pids=[7],
        num_worker_restarts=0,
        num_steps=2,
        compiled_graph=False,
        engine_pid=6,
    ),
    WorkerSpec(config=CONFIG, num_blocks=8, eos_token_ids=[2], tp_rank=0, pp_rank=1, num_threads=1),
    SchedulerOutput(
        new_requests=[
            NewRequestData(
                req_id="a",
                token_ids=[1],
                num_prompt_tokens=1,
                sampling_params=PARAMS,
                block_ids=[0],
                num_computed_tokens=0,
            )
        ],
        cached_requests=[CachedRequestData(req_id="b", new_block_ids=[1], num_computed_tokens=4, new_token_ids=[9])],
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
        finished_req_ids=["c"],
    ),
    HiddenStates(shape=[1, 2], dtype="float32"),
    ModelRunnerOutput(sampled={"a": [5]}, logprobs={"a": [TokenLogprobs([5, 6], [-0.1, -2.0], 1)]}),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(codec.MESSAGES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(message: object) -> None:
    assert codec.decode(type(message), codec.encode(message)) == message


@pytest.mark.parametrize("kind", codec.MESSAGES, ids=lambda k: k.__name__)
def test_ray_envelope_names_a_decoder_and_holds_msgpack(kind: type) -> None:
    """What register() gives Ray, pickled as Ray's reducer pickles it: (decoder, (msgpack,))."""
    decoder = codec._DECODERS[kind]
    blob = ray.cloudpickle.dumps(decoder)
    assert len(blob) < 100 and pickle.loads(blob) is decoder
    message = next(m for m in SAMPLES if type(m) is kind)
    assert pickle.loads(ray.cloudpickle.dumps((decoder, codec.encode(message))))[0](codec.encode(message)) == message


def test_a_message_its_type_refuses_is_a_validation_error() -> None:
    bad = EngineRequest(request_id="a", prompt_token_ids=[1.5], sampling_params=PARAMS)  # type: ignore[list-item]
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids"):
        codec.decode(EngineRequest, codec.encode(bad))


def test_unreadable_finds_the_decode_error_behind_a_ray_error() -> None:
    why = msgspec.ValidationError("Expected `int`")
    assert codec.unreadable(SimpleNamespace(cause=SimpleNamespace(client_exc=why))) is why
    assert codec.unreadable(SimpleNamespace(cause=RuntimeError("boom"))) is None
    assert codec.unreadable(RuntimeError("boom")) is None


def test_the_empty_step_output_is_fresh_each_time() -> None:
    a, b = ModelRunnerOutput.empty(), ModelRunnerOutput.empty()
    a.failed["x"] = "why"
    assert b == ModelRunnerOutput(sampled={}) and a.sampled is not b.sampled
