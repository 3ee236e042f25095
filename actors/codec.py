"""Codec: the one place where the engine's messages become bytes and bytes become messages.

Actor methods take and return the message Structs themselves (`EngineActor.add_request(request:
EngineRequest)`, `Worker.execute(step: SchedulerOutput, previous: HiddenStates | None) ->
StageOutput`, ...). On the wire they are msgpack: `register()` gives Ray one serializer per type
in MESSAGES (ray.util.register_serializer): msgspec msgpack out, a decoder typed to that Struct
in, so every message is checked against its type as it is read. No message is pickled: Ray's
own envelope (a pickle) around the msgpack bytes holds only a reference to that type's decoder
here. A message its receiver cannot read fails the call before the method runs (unreadable()).

Ray applies a registered serializer wherever it serializes a value of that exact type: actor
creation arguments, actor call arguments and results, and Compiled Graph channels (they share
the process's serialization context). A registration holds in the process that made it and it
is the sender's that counts, so every process that sends messages calls register(): the driver
once Ray is up, the engine actor and each worker in their __init__. Receivers need nothing.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import ray

from cadenza.config import EngineConfig
from cadenza.messages import (
    EngineRequest,
    HiddenStates,
    ModelRunnerOutput,
    OutputBatch,
    Refusal,
    SchedulerOutput,
    WorkerSpec,
)
from cadenza.stats import ServingStats

T = TypeVar("T")

# Everything that crosses between actors. Anything else an actor method takes or returns is a
# builtin (a request id list, an ack number, the health reason) or a Ray handle.
MESSAGES: tuple[type, ...] = (
    EngineConfig,  # driver -> engine actor, at creation
    EngineRequest,  # driver -> engine actor
    Refusal,  # engine actor -> driver, when it will not queue a request
    OutputBatch,  # engine actor -> driver
    ServingStats,  # engine actor -> driver
    WorkerSpec,  # engine actor -> worker, at creation
    SchedulerOutput,  # engine actor -> every worker, each step
    HiddenStates,  # pipeline stage -> the next stage, each step
    ModelRunnerOutput,  # the driver worker -> engine actor, each step
)

_encoder = msgspec.msgpack.Encoder()


class _Decoder:
    """Ray's deserializer for one message type. Ray's envelope holds it, so it pickles as a
    reference to this module's global of its name (Python's pickle protocol: a `__reduce__`
    that returns a string): a few bytes and no lookups, never the decoder itself."""

    __module__ = __name__

    def __init__(self, kind: type) -> None:
        self.name = f"decode_{kind.__name__}"
        self.decoder = msgspec.msgpack.Decoder(kind)

    def __call__(self, data: bytes) -> object:
        return self.decoder.decode(data)

    def __reduce__(self) -> str:
        return self.name


_DECODERS: dict[type, _Decoder] = {kind: _Decoder(kind) for kind in MESSAGES}
globals().update((d.name, d) for d in _DECODERS.values())  # what each one's pickle names


def encode(message: object) -> bytes:
    return _encoder.encode(message)


def decode(kind: type[T], data: bytes) -> T:
    """`data` as a `kind`, validated (msgspec.ValidationError when it is not one)."""
    return _DECODERS[kind](data)


def unreadable(error: BaseException) -> msgspec.ValidationError | None:
    """Why the receiver of a call could not read an argument as its type: Ray fails the call
    (a RayTaskError whose cause carries the decode error) before the method runs. None when
    the call failed for any other reason."""
    why = getattr(getattr(error, "cause", None), "client_exc", None)
    return why if isinstance(why, msgspec.ValidationError) else None


def register() -> None:
    """Make Ray send every message type as msgpack from this process. Needs Ray initialised;
    calling it again is harmless."""
    for kind, decoder in _DECODERS.items():
        ray.util.register_serializer(kind, serializer=encode, deserializer=decoder)
