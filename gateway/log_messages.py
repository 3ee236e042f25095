"""The messages between Serve replicas and the shared response log (shared_log.py), and the
engine deltas a re-issue replays; free of Ray, so the plain gateway imports them at no cost."""

from __future__ import annotations

import msgspec

from cadenza.outputs import RequestOutput

_delta_encoder = msgspec.msgpack.Encoder()
_delta_decoder = msgspec.msgpack.Decoder(RequestOutput)


def encode_delta(delta: RequestOutput) -> bytes:
    return _delta_encoder.encode(delta)


def decode_delta(data: bytes) -> RequestOutput:
    return _delta_decoder.decode(data)


Kept = tuple[str, bytes]


class ReissueSpec(msgspec.Struct, frozen=True):
    """What runs a response again elsewhere: its request and when it was created."""

    create: bytes  # the response.create body, as JSON
    tenant: str | None
    priority: int
    created_at: float


class LogUpdate(msgspec.Struct):
    """One response's news since its owner's last acknowledged flush."""

    response_id: str
    epoch: int
    first: int  # the index of events[0] in the response's events
    events: list[Kept]
    count: int  # events appended so far, kept or not
    response: bytes | None  # the latest response object, when it changed
    first_delta: int
    deltas: list[bytes]  # engine deltas (msgpack RequestOutput)
    overflowed: bool
    done: bool
    spec: ReissueSpec | None = None  # with the first update


class Adoption(msgspec.Struct):
    """An orphaned response handed to a surviving replica, with everything to go on."""

    response_id: str
    epoch: int
    spec: ReissueSpec
    events: list[Kept]
    count: int
    response: bytes
    deltas: list[bytes]
    overflowed: bool


class FlushReply(msgspec.Struct):
    cancels: list[str]  # this owner's responses another replica cancelled
    fenced: list[str]  # responses this owner no longer owns (re-issued elsewhere)
    adopted: list[Adoption]
    lost: list[str] = []  # unknown to the log (it restarted empty): send them again, whole


class LogSlice(msgspec.Struct):
    events: list[Kept]  # kept events from index `first`
    first: int
    kept: int
    done: bool
    overflowed: bool
    response: bytes
