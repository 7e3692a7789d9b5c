"""The wire form of a tensor held in a Mooncake-registered buffer (``net.mooncake``).

Owns ``MooncakeHandle`` only: a plain msgspec struct (no Mooncake import), so that
``messages`` can carry it as a ``Value`` and in ``Ack`` without loading the transfer engine.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from walkserve.runtime.tensorcodec import TensorHeader

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Session = Annotated[str, msgspec.Meta(min_length=3, max_length=300)]


class MooncakeHandle(msgspec.Struct, frozen=True, tag="mooncake", tag_field="type"):
    """``header.nbytes`` bytes at address ``addr`` of the registered buffer of the transfer
    engine ``session`` (``host:rpc_port``), held until the handle comes back in an ``Ack``.
    ``ticket`` tells reuses of one address apart."""

    session: Session
    addr: NonNegInt
    ticket: NonNegInt
    header: TensorHeader


__all__ = ["MooncakeHandle"]
