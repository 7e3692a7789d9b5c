"""Control-plane messages: every struct that crosses a ZeroMQ socket, and their one codec.

Owns the message vocabulary and its wire form (msgpack via msgspec, no pickle). Each message
is a frozen ``msgspec.Struct`` tagged by a ``"type"`` field; ``Message`` is their union, and
``decode`` accepts exactly its members:

    data = encode(RunNode(["r1"], "denoiser", 3, [ref]))   # b'\\x85\\xa4type\\xa7RunNode...'
    match decode(data):                                    # MessageError if malformed
        case RunNode(request_ids=ids, inputs=refs): ...

Tensors travel as ``TensorRef``: small ones ``Inline`` (header + bytes in the message), large
ones as an ``ShmHandle`` into a pool the receiver attached at start-up (``AttachPools``). A
receiver of a handle sends ``Ack`` to the pool's owner once it no longer needs the slot.

Direction (C: conductor, W: worker):

    W->C  Hello, Heartbeat, NodeDone, NodeFailed
    C->W  RunNode, Cancel, Shutdown
    both  AttachPools (the sender's own pools), Ack (to the owner of the handles' pool)

To add a message: subclass ``_Msg`` (repeat ``frozen=True``) and add it to ``Message``.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

from walkserve.runtime.shm import ShmHandle, ShmPoolSpec
from walkserve.runtime.tensorcodec import TensorHeader

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class MessageError(ValueError):
    """Bytes that are not a valid ``Message`` (bad msgpack, unknown type, wrong field)."""


# ------------------------------------------------------------------------- tensor refs


class Inline(msgspec.Struct, frozen=True, tag="inline", tag_field="type"):
    """A small tensor carried in the message itself."""

    header: TensorHeader
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != self.header.nbytes:
            raise ValueError(f"inline data has {len(self.data)} bytes, header says {self.header}")


TensorRef: TypeAlias = Inline | ShmHandle


# ---------------------------------------------------------------------------- messages


class _Msg(msgspec.Struct, frozen=True, tag=True, tag_field="type"):
    """Base of all messages: the tag is the class name."""


class Hello(_Msg, frozen=True):
    """A worker is up and ready for ``AttachPools``."""

    rank: NonNegInt
    pid: PosInt


class AttachPools(_Msg, frozen=True):
    """The shared-memory pools whose handles this worker may receive."""

    pools: list[ShmPoolSpec]


class Shutdown(_Msg, frozen=True):
    """Stop: drop in-flight work, release everything, exit."""


class Heartbeat(_Msg, frozen=True):
    """Liveness. ``t`` is the sender's ``time.monotonic()`` (comparable on one host)."""

    rank: NonNegInt
    t: float


class RunNode(_Msg, frozen=True):
    """Run ``node`` once for a batch of requests. ``inputs`` are in the node's parameter
    order, each batched over ``request_ids``; ``iteration`` counts loop steps from 0."""

    request_ids: list[RequestId]
    node: Name
    iteration: NonNegInt
    inputs: list[TensorRef]


class NodeDone(_Msg, frozen=True):
    """``node`` ran for ``request_ids`` at ``iteration``; ``outputs`` in the node's order."""

    request_ids: list[RequestId]
    node: Name
    iteration: NonNegInt
    outputs: list[TensorRef]


class NodeFailed(_Msg, frozen=True):
    """``node`` raised for ``request_ids``; ``error`` is a message fit for a client."""

    request_ids: list[RequestId]
    node: Name
    error: str


class Cancel(_Msg, frozen=True):
    """Drop all state of ``request_id`` (aborted, failed, or client gone)."""

    request_id: RequestId


class Ack(_Msg, frozen=True):
    """The sender is done reading these handles; their slots may be reused."""

    handles: list[ShmHandle]


Message: TypeAlias = (
    Hello | AttachPools | Shutdown | Heartbeat | RunNode | NodeDone | NodeFailed | Cancel | Ack
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """The wire form of ``msg``."""
    if not isinstance(msg, _Msg):
        raise TypeError(f"not a control-plane message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message ``data`` encodes; ``MessageError`` for anything else."""
    try:
        return _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise MessageError(f"invalid control-plane message: {e}") from e
