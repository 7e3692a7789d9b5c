"""How a value is written in a message (``messages``): a tensor ``Inline`` in the message or
in shared memory (``ShmHandle``, ``TensorRef``), a value that stays where it was made
(``ObjectRef``), a sequence of values (``Seq``), and Python scalars as themselves (``Value``:
any of these). Also the bounded field types the messages share (``NonNegInt``, ``Name``, ...).

msgpack via msgspec, no pickle: a tensor is a header and its bytes, an object that cannot be
encoded never leaves its process (only its key does)."""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec

from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.shm import ShmHandle
from walkserve.runtime.tensorcodec import TensorHeader

__all__ = [
    "Inline",
    "Name",
    "NonNegInt",
    "ObjectKey",
    "ObjectRef",
    "PosInt",
    "RequestId",
    "Seq",
    "TensorRef",
    "Value",
]

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
ObjectKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


# ------------------------------------------------------------------------- tensor refs


class Inline(msgspec.Struct, frozen=True, tag="inline", tag_field="type"):
    """A small tensor carried in the message itself."""

    header: TensorHeader
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != self.header.nbytes:
            raise ValueError(f"inline data has {len(self.data)} bytes, header says {self.header}")


TensorRef: TypeAlias = Inline | ShmHandle


# ------------------------------------------------------------------------------ values


class ObjectRef(msgspec.Struct, frozen=True, tag="object", tag_field="type", weakref=True):
    """A value that stays where it was made: in the per-request store of worker ``rank``
    under ``key``. Objects that cannot be encoded (a Hugging Face cache) are always held;
    tensors are held unless a client or the conductor itself needs their bytes (``shape``
    then says what the tensor is). Only that worker resolves a key, and only for the request
    that made it; a consumer on another rank of the same host pulls a held tensor from it
    directly (``Fetch``), never through the server process; an object never leaves it. The
    conductor's process releases a key (``Release``) when its last reader is done. ``at``: where
    a held tensor's bytes wait for readers on other hosts (a block of the producer's Mooncake
    send buffer, read one-sided by the consumer, ``net.mooncake``), freed with the key."""

    rank: NonNegInt
    key: ObjectKey
    shape: list[NonNegInt] | None = None
    at: MooncakeHandle | None = None


class Seq(msgspec.Struct, frozen=True, tag="seq", tag_field="type"):
    """A tuple, list or ``torch.Size`` of values."""

    kind: Literal["tuple", "list", "size"]
    items: list[Value]


# Any value a node reads or produces, on the wire. bool before int: msgpack keeps them apart.
Value: TypeAlias = (
    Inline | ShmHandle | MooncakeHandle | ObjectRef | Seq | bool | int | float | str | None
)
