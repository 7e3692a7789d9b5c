"""Shared-memory data plane: server-owned segments that carry tensor bytes between processes.

Owns the segment format, the wire types and the owner's side (``ShmPool``): segment lifetime
(create, reuse, unlink), per-slot reader counts, and the validation of acked handles. The read
side, in every process that receives handles, is ``shmreader.ShmReader``. What crosses a process
boundary:

- ``ShmPoolSpec``, sent once at start-up by the owner: the pool id and, for every segment
  index, the segment's name and capacity. Names are made by the pool; a reader opens only
  names from a spec it was given, never a name taken from a handle.
- ``ShmHandle``, one per tensor: pool id, segment index, generation, ``TensorHeader``.
- An ack per reader per handle, carried back over the control plane (``messages.Ack``); the
  owner calls ``ShmPool.ack``.

One segment is one slot. Slots come in size classes (powers of two, ``min_slot_bytes`` up to
``max_slot_bytes``); each class holds up to ``slots_per_class`` segments, created on first need.

Segment layout (little-endian; the tensor starts 64-byte aligned)::

    0     4     6     8          16          24          32          64            64 + capacity
    +-----+-----+-----+----------+-----------+-----------+-----------+-------------+
    |magic| ver | pad |generation| capacity  |  nbytes   |  (unused) | tensor bytes|
    +-----+-----+-----+----------+-----------+-----------+-----------+-------------+

Slot lifecycle; the generation is bumped on both edges, so a handle is readable exactly while
its slot holds the tensor it was made for::

    idle --write(readers=N): gen+1--> held(N) --ack--> held(N-1) ... --last ack: gen+1--> idle

A reader (``shmreader.py``) checks the generation in the segment before and after copying, so
it never returns bytes from a slot that was released or reused, even when a buggy peer reads
after its ack.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Annotated

import msgspec
import torch

from walkserve.runtime.config import KiB, MiB, ShmPoolConfig

__all__ = [
    "KiB",
    "MiB",
    "InvalidHandle",
    "PoolClosed",
    "PoolExhausted",
    "PoolStats",
    "SegmentSpec",
    "ShmError",
    "ShmHandle",
    "ShmPool",
    "ShmPoolConfig",
    "ShmPoolSpec",
    "StaleHandle",
    "ClassStats",
    "segment_name",
]
from walkserve.runtime.tensorcodec import TensorHeader, copy_into, header_of

MAGIC = b"WSHM"
LAYOUT_VERSION = 1
HEADER = struct.Struct("<4sHHQQQ")  # magic, version, pad, generation, capacity, nbytes
_GEN_OFFSET = 8
_NBYTES_OFFSET = 24
DATA_OFFSET = 64

_POOL_ID = re.compile(r"^[0-9a-f]{16}$")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PoolId = Annotated[str, msgspec.Meta(pattern=_POOL_ID.pattern)]


# ------------------------------------------------------------------------------ errors


class ShmError(Exception):
    """Base class of shared-memory errors."""


class PoolExhausted(ShmError):
    """No slot of the needed size class became free (at once, or within the timeout)."""


class PoolClosed(ShmError):
    """The pool was closed."""


class InvalidHandle(ShmError, ValueError):
    """A handle that does not name a slot of a known pool, or disagrees with that slot."""


class StaleHandle(InvalidHandle):
    """The slot no longer holds the tensor the handle was made for (released or reused)."""


# ------------------------------------------------------------------------- wire types


class SegmentSpec(msgspec.Struct, frozen=True):
    """One segment: its name in the shared-memory namespace and its payload capacity."""

    name: str
    capacity: Annotated[int, msgspec.Meta(gt=0)]


class ShmPoolSpec(msgspec.Struct, frozen=True):
    """Everything a reader needs to attach to a pool: segment index ``i`` is ``segments[i]``.
    Segments may not exist yet (they are created on first use); readers attach lazily."""

    pool_id: str
    segments: tuple[SegmentSpec, ...]

    def __post_init__(self) -> None:
        if not _POOL_ID.fullmatch(self.pool_id):
            raise ValueError(f"pool_id must be 16 lowercase hex digits, got {self.pool_id!r}")
        for index, seg in enumerate(self.segments):
            if seg.name != segment_name(self.pool_id, index):
                raise ValueError(f"segment {index} has unexpected name {seg.name!r}")


class ShmHandle(msgspec.Struct, frozen=True, tag="shm", tag_field="type"):
    """A tensor held in slot ``index`` of pool ``pool_id`` while the slot is at
    ``generation``. Made only by ``ShmPool.write``; a member of ``messages.TensorRef``."""

    pool_id: PoolId
    index: NonNegInt
    generation: NonNegInt
    header: TensorHeader


def segment_name(pool_id: str, index: int) -> str:
    """The name of segment ``index`` of pool ``pool_id`` (at most 31 characters, the macOS
    limit)."""
    return f"wsp_{pool_id}_{index}"


# ------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class ClassStats:
    """One size class: ``idle + in_use == created <= limit``."""

    slot_bytes: int
    limit: int  # most segments this class may create
    created: int
    idle: int
    in_use: int


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool, smallest class first."""

    classes: tuple[ClassStats, ...]

    @property
    def idle(self) -> int:
        return sum(c.idle for c in self.classes)

    @property
    def in_use(self) -> int:
        return sum(c.in_use for c in self.classes)


# -------------------------------------------------------------------------------- pool


@dataclass
class _Slot:
    shm: SharedMemory
    buf: memoryview  # the whole segment, header included
    capacity: int
    generation: int = 0
    readers: int = 0  # 0: idle
    header: TensorHeader | None = None

    def store_generation(self) -> None:
        struct.pack_into("<Q", self.buf, _GEN_OFFSET, self.generation)


class ShmPool:
    """The owner's side: creates segments, copies tensors in, tracks readers, unlinks on
    ``close()`` (also called at interpreter exit, and by the context manager).

    Thread-safe: ``write`` may block waiting for a slot while another thread calls ``ack``.
    ``close()`` must not race with a ``write`` in progress.
    """

    def __init__(self, config: ShmPoolConfig | None = None) -> None:
        self.config = config or ShmPoolConfig()
        self.pool_id = secrets.token_hex(8)
        self._sizes = self.config.class_sizes
        per_class = self.config.slots_per_class
        self._slots: list[_Slot | None] = [None] * (len(self._sizes) * per_class)
        self._cond = threading.Condition()
        self._closed = False
        self.spec = ShmPoolSpec(
            self.pool_id,
            tuple(
                SegmentSpec(segment_name(self.pool_id, i), self._sizes[i // per_class])
                for i in range(len(self._slots))
            ),
        )
        # Holds the created segments for the finalizer, which must not reference self.
        self._created: list[SharedMemory] = []
        self._finalizer = weakref.finalize(self, _release, self._created, os.getpid())

    def write(self, tensor: torch.Tensor, readers: int = 1) -> ShmHandle:
        """Copy ``tensor`` into a free slot held for ``readers`` acks; return its handle."""
        if readers < 1:
            raise ValueError(f"readers must be >= 1, got {readers}")
        header = header_of(tensor)
        cls = self._class_for(header.nbytes)
        with self._cond:
            index = self._claim(cls)
            slot = self._slot(index)
            slot.readers = readers
            slot.header = header
            slot.generation += 1
            slot.store_generation()
            struct.pack_into("<Q", slot.buf, _NBYTES_OFFSET, header.nbytes)
        try:
            # Outside the lock: nobody else touches a claimed slot, and no reader has its
            # handle before we return it.
            copy_into(tensor, slot.buf[DATA_OFFSET : DATA_OFFSET + slot.capacity], header)
        except BaseException:
            with self._cond:
                self._release_slot(slot)
            raise
        return ShmHandle(self.pool_id, index, slot.generation, header)

    def ack(self, handle: ShmHandle) -> None:
        """One reader is done with ``handle``; the slot turns idle after the last ack.
        Acks arriving after ``close()`` are ignored (late acks are normal at shutdown)."""
        with self._cond:
            if self._closed:
                return
            if handle.pool_id != self.pool_id:
                raise InvalidHandle(f"handle of pool {handle.pool_id!r} acked to {self.pool_id!r}")
            if not 0 <= handle.index < len(self._slots):
                raise InvalidHandle(f"segment index {handle.index} out of range")
            slot = self._slots[handle.index]
            if slot is None:
                raise InvalidHandle(f"segment {handle.index} was never written")
            if slot.readers == 0 or slot.generation != handle.generation:
                raise StaleHandle(
                    f"slot {handle.index} is at generation {slot.generation}, handle has "
                    f"{handle.generation} (acked twice, or for a released slot)"
                )
            if slot.header != handle.header:
                raise InvalidHandle(f"handle header does not match slot {handle.index}")
            slot.readers -= 1
            if slot.readers == 0:
                self._release_slot(slot)

    def stats(self) -> PoolStats:
        per_class = self.config.slots_per_class
        classes = []
        with self._cond:
            for c, size in enumerate(self._sizes):
                slots = [s for s in self._slots[c * per_class : (c + 1) * per_class] if s]
                in_use = sum(1 for s in slots if s.readers > 0)
                classes.append(ClassStats(size, per_class, len(slots), len(slots) - in_use, in_use))
        return PoolStats(tuple(classes))

    def close(self) -> None:
        """Unlink every segment (idempotent). Readers' existing mappings stay valid, but no
        new reader can attach and blocked writers raise ``PoolClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._finalizer()

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _class_for(self, nbytes: int) -> int:
        for c, size in enumerate(self._sizes):
            if nbytes <= size:
                return c
        raise ValueError(
            f"a tensor of {nbytes} bytes exceeds the largest slot ({self._sizes[-1]} bytes); "
            "raise ShmPoolConfig.max_slot_bytes"
        )

    def _claim(self, cls: int) -> int:
        """Index of an idle (or newly created) slot of class ``cls``; waits or raises when
        none is free. Call with the lock held."""
        per_class = self.config.slots_per_class
        indices = range(cls * per_class, (cls + 1) * per_class)
        deadline = time.monotonic() + self.config.block_timeout_s
        while True:
            if self._closed:
                raise PoolClosed("the shared-memory pool is closed")
            for i in indices:
                slot = self._slots[i]
                if slot is not None and slot.readers == 0:
                    return i
            for i in indices:
                if self._slots[i] is None:
                    self._slots[i] = self._create(i, self._sizes[cls])
                    return i
            remaining = deadline - time.monotonic()
            if self.config.when_exhausted == "raise" or remaining <= 0:
                waited = "" if self.config.when_exhausted == "raise" else " within timeout"
                raise PoolExhausted(
                    f"no free {self._sizes[cls]}-byte slot{waited}: all {per_class} held by "
                    "readers that have not acked; raise slots_per_class or ack sooner"
                )
            self._cond.wait(remaining)

    def _create(self, index: int, capacity: int) -> _Slot:
        size = DATA_OFFSET + capacity
        try:
            shm = SharedMemory(name=segment_name(self.pool_id, index), create=True, size=size)
        except FileExistsError as e:
            raise ShmError(f"segment name collision for {e.filename!r}") from e
        self._created.append(shm)
        # Reserve the pages now, so a full /dev/shm is an error here and not a SIGBUS later.
        fd = getattr(shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ShmError(f"cannot reserve {size} bytes of shared memory: {e}") from e
        buf = shm.buf  # the segment's own view (a derived one would block its close())
        assert buf is not None
        HEADER.pack_into(buf, 0, MAGIC, LAYOUT_VERSION, 0, 0, capacity, 0)
        return _Slot(shm, buf, capacity)

    def _slot(self, index: int) -> _Slot:
        slot = self._slots[index]
        assert slot is not None
        return slot

    def _release_slot(self, slot: _Slot) -> None:
        slot.readers = 0
        slot.header = None
        slot.generation += 1
        slot.store_generation()
        self._cond.notify_all()


def _release(segments: list[SharedMemory], owner_pid: int) -> None:
    """Unlink and unmap the pool's segments; only in the process that created them."""
    if os.getpid() != owner_pid:
        return
    for shm in segments:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()
        close_quietly(shm.close)
    segments.clear()


def close_quietly(close: Callable[[], object]) -> None:
    """Unmap, unless a zero-copy tensor still views the mapping: then the mapping lives on
    until that tensor dies (the view keeps it referenced)."""
    with contextlib.suppress(BufferError):
        close()


def read_state(buf: memoryview) -> tuple[int, int]:
    """(generation, nbytes) as stored in a segment's header."""
    (gen,) = struct.unpack_from("<Q", buf, _GEN_OFFSET)
    (nbytes,) = struct.unpack_from("<Q", buf, _NBYTES_OFFSET)
    return gen, nbytes
