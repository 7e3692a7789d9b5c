"""Tensors between hosts through Mooncake's transfer engine (``mooncake-transfer-engine``).

Owns one process's ``TransferEngine`` (protocol ``tcp``, or ``rdma`` where present; metadata
mode ``P2PHANDSHAKE``, so no etcd), its two registered buffers (registered once at start-up,
reused for every transfer: no registration per transfer) and the ``MooncakeTransport`` that
implements ``transport.Transport`` on them. What crosses its boundary: ``MooncakeHandle``
payloads (``net.handles``: session, address, header) on the control plane, tensor bytes
pulled by the consumer's engine from the producer's buffer::

    producer.send(t)        copy t into a free block of the producer's *send* buffer
                            -> MooncakeHandle(session, addr, ticket, header)
    consumer.receive(h)     one transfer_sync_read from h.session / h.addr into a block of the
                            consumer's *receive* buffer, then one copy into a fresh tensor;
                            the handle is the token
    producer.release([h])   the block is free again (the consumer's Ack)

Small tensors (under ``inline_max_bytes``), scalars and sequences travel as ``ShmTransport``
sends them (inline); unencodable objects stay in the worker's object store. A tensor larger
than the free space of the send buffer also travels inline (logged once): correctness first.

Rank to rank across hosts, the same blocks: a worker's ``ObjectStore`` exports each tensor it
holds into its ``SendPool`` (its ``ObjectRef`` carries the handle as ``at``), a consumer rank on
another host pulls it with ``MooncakeEngine.pull`` (no message to the producer), and the block
is freed when the server releases the key, or the request ends (``Release``, ``Cancel``)::

    rank 0 (host A): store[k] = t; at = send_pool.write(t) --ObjectRef(0, k, at)--> server
    server: routes the reference                           --RunBatch / StartRegions--> rank 1
    rank 1 (host B): engine.pull(at)  (one transfer_sync_read from rank 0's send buffer)

The import of ``mooncake`` happens when an engine is made; it needs Debian's ``libibverbs1``
(and ``librdmacm1``) even for TCP. ``available()`` says whether it imports, and why not.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from walkserve.runtime.messages import Value
from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.shm import MiB
from walkserve.runtime.tensorcodec import DTYPES, TensorHeader
from walkserve.runtime.transport import (
    INLINE_MAX_BYTES,
    ObjectStore,
    ShmTransport,
    TransportError,
    inline,
)

log = logging.getLogger("walkserve.net")

_ALIGN = 64
_WIRE = {dtype: name for name, dtype in DTYPES.items()}


class MooncakeError(TransportError):
    """A Mooncake call failed (the message has its return code)."""


def available() -> tuple[bool, str]:
    """(whether ``mooncake.engine`` imports here, the reason when it does not)."""
    try:
        os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO lines are per transfer
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a missing libibverbs
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def local_ip_towards(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


@dataclass(frozen=True)
class MooncakeConfig:
    """``host``: the address peers reach this engine at. ``send_bytes`` / ``recv_bytes``: the
    two registered buffers (the largest tensor that can travel this way is their size)."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    send_bytes: int = 256 * MiB
    recv_bytes: int = 256 * MiB
    device: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        for name in ("send_bytes", "recv_bytes"):
            if getattr(self, name) < _ALIGN:
                raise ValueError(f"{name} must be >= {_ALIGN}, got {getattr(self, name)}")


class _Arena:
    """First-fit blocks of one registered buffer (a uint8 tensor), 64-byte aligned."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        self.size = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted
        self._used: dict[int, int] = {}  # offset -> length
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        need = max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        with self._lock:
            for k, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[k]
                    else:
                        self._free[k] = (off + need, length - need)
                    self._used[off] = need
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            length = self._used.pop(offset, None)
            if length is None:
                raise MooncakeError(f"offset {offset} is not an allocated block")
            blocks = sorted([*self._free, (offset, length)])
            merged: list[tuple[int, int]] = []
            for off, n in blocks:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free = merged

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._used)


class MooncakeEngine:
    """One process's transfer engine and its registered send and receive buffers."""

    def __init__(self, config: MooncakeConfig | None = None) -> None:
        ok, why = available()
        if not ok:
            raise MooncakeError(
                f"mooncake-transfer-engine does not import here ({why}); install "
                "mooncake-transfer-engine-non-cuda and Debian's libibverbs1 and librdmacm1"
            )
        from mooncake.engine import TransferEngine

        self.config = config or MooncakeConfig()
        self.engine = TransferEngine()
        rc = self.engine.initialize(self.config.host, "P2PHANDSHAKE", self.config.protocol, "")
        if rc != 0:
            raise MooncakeError(f"TransferEngine.initialize({self.config.host!r}) returned {rc}")
        self.session = f"{self.config.host}:{self.engine.get_rpc_port()}"
        self.send_arena = _Arena(self.config.send_bytes)
        self.recv_arena = _Arena(self.config.recv_bytes)
        for arena in (self.send_arena, self.recv_arena):
            rc = self.engine.register_memory(arena.base, arena.size)
            if rc != 0:
                raise MooncakeError(f"register_memory of {arena.size} bytes returned {rc}")
        self._read_lock = threading.Lock()

    def read(self, session: str, remote_addr: int, dst_offset: int, nbytes: int) -> None:
        """Pull ``nbytes`` from ``remote_addr`` of ``session`` into the receive buffer."""
        with self._read_lock:
            rc = self.engine.transfer_sync_read(
                session, self.recv_arena.base + dst_offset, remote_addr, nbytes
            )
        if rc != 0:
            raise MooncakeError(
                f"transfer_sync_read of {nbytes} bytes from {session} returned {rc}"
            )

    def pull(self, handle: MooncakeHandle) -> torch.Tensor:
        """A fresh tensor with the bytes ``handle`` names (one remote read into the receive
        buffer, one copy out)."""
        header = handle.header
        out = torch.empty(header.shape, dtype=header.torch_dtype)
        if not header.nbytes:
            return out
        arena = self.recv_arena
        offset = arena.alloc(header.nbytes)
        if offset is None:
            raise MooncakeError(
                f"a {header.nbytes}-byte tensor does not fit the free Mooncake receive buffer "
                f"({arena.size} bytes); raise MooncakeConfig.recv_bytes"
            )
        try:
            self.read(handle.session, handle.addr, offset, header.nbytes)
            ctypes.memmove(out.data_ptr(), arena.base + offset, header.nbytes)
        finally:
            arena.free(offset)
        return out

    def close(self) -> None:
        for arena in (self.send_arena, self.recv_arena):
            self.engine.unregister_memory(arena.base)


class SendPool:
    """Blocks of the send buffer that readers pull: what ``ShmTransport`` calls its pool
    (``write``, ``ack``), and where a worker's ``ObjectStore`` exports the tensors it holds for
    ranks on other hosts (``transport.Exports``)."""

    def __init__(self, engine: MooncakeEngine) -> None:
        self.engine = engine
        self._tickets = itertools.count()
        self._held: dict[tuple[int, int], int] = {}  # (addr, ticket) -> offset
        self.writes = 0
        self._lock = threading.Lock()
        self._warned = False

    def write(self, t: torch.Tensor) -> MooncakeHandle | None:
        src = t.detach().to("cpu").contiguous()
        nbytes = src.numel() * src.element_size()
        arena = self.engine.send_arena
        offset = arena.alloc(nbytes)
        if offset is None:
            if not self._warned:
                log.warning(
                    "a %d-byte tensor does not fit the free Mooncake send buffer (%d bytes); "
                    "sending it inline",
                    nbytes,
                    arena.size,
                )
                self._warned = True
            return None
        if nbytes:
            ctypes.memmove(arena.base + offset, src.data_ptr(), nbytes)
        ticket = next(self._tickets)
        with self._lock:
            self.writes += 1
            self._held[(arena.base + offset, ticket)] = offset
        header = TensorHeader(_WIRE[src.dtype], tuple(src.shape), nbytes)
        return MooncakeHandle(self.engine.session, arena.base + offset, ticket, header)

    def ack(self, handle: MooncakeHandle) -> None:
        with self._lock:
            offset = self._held.pop((handle.addr, handle.ticket), None)
        if offset is None:
            raise MooncakeError(f"handle {handle.addr}/{handle.ticket} is not held here")
        self.engine.send_arena.free(offset)


class MooncakeTransport(ShmTransport):
    """``transport.Transport`` over a ``MooncakeEngine`` (see the module docstring)."""

    def __init__(
        self,
        engine: MooncakeEngine,
        *,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        objects: ObjectStore | None = None,
    ) -> None:
        self.engine = engine
        self._send_pool = SendPool(engine)
        self.reads = 0  # tensors received through the engine
        super().__init__(
            cast(Any, self._send_pool),
            cast(Any, None),
            inline_max_bytes=inline_max_bytes,
            objects=objects,
        )

    def _pack(self, value: Any, request_id: str, written: list[Any]) -> Value:
        if (
            isinstance(value, torch.Tensor)
            and value.dtype in _WIRE
            and value.layout == torch.strided
            and not (value.is_nested or value.is_meta)
            and not value.numel() * value.element_size() < self.inline_max_bytes
        ):
            handle = self._send_pool.write(value)
            if handle is not None:
                written.append(handle)
                self.bytes_out += handle.header.nbytes
                return handle  # type: ignore[return-value]
            self.bytes_out += value.numel() * value.element_size()
            return inline(value.detach().to("cpu").contiguous())
        return super()._pack(value, request_id, written)

    def _unpack(self, payload: Any, request_id: str, tokens: list[Any]) -> Any:
        if isinstance(payload, MooncakeHandle):
            tensor = self.read(payload)
            self.reads += 1
            self.bytes_in += payload.header.nbytes
            tokens.append(payload)
            return tensor
        return super()._unpack(payload, request_id, tokens)

    @property
    def writes(self) -> int:
        """Tensors sent through the engine."""
        return self._send_pool.writes

    @property
    def held(self) -> int:
        """Blocks of the send buffer not yet released by their consumer."""
        return self.engine.send_arena.in_use

    def read(self, handle: MooncakeHandle) -> torch.Tensor:
        """A fresh tensor with the bytes ``handle`` names (one remote read, one copy)."""
        return self.engine.pull(handle)

    def release(self, tokens: Sequence[Any]) -> None:
        for handle in tokens:
            try:
                if not isinstance(handle, MooncakeHandle):
                    raise MooncakeError(f"not a Mooncake handle: {type(handle).__name__}")
                self._send_pool.ack(handle)
            except MooncakeError as e:
                log.warning("bad Mooncake release: %s", e)


__all__ = [
    "MooncakeConfig",
    "MooncakeEngine",
    "MooncakeError",
    "MooncakeTransport",
    "SendPool",
    "available",
    "local_ip_towards",
]
