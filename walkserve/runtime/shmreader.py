"""The read side of the shared-memory data plane (``shm.py``): ``ShmReader``, one per process
that receives tensors by handle.

Owns this process's mappings of other processes' segments and the checks a handle passes before
its bytes are read. It opens only segments named in an ``ShmPoolSpec`` it was given (never a name
taken from a handle), maps them without registering them with the resource tracker (the owner
alone unlinks), and checks every handle against the spec and against the segment's own header.
What crosses its boundary: ``ShmPoolSpec`` in (``add``, ``forget``), ``ShmHandle`` in, tensors
out (a copy, a zero-copy view, or into a caller's buffer), and ``InvalidHandle``/``StaleHandle``.
It never acks: the process that read a handle sends the ack over the control plane.

A read checks the slot's generation in the segment before copying and, for a copy, again after
it (the slot lifecycle is drawn in ``shm.py``), so it never returns bytes from a slot that was
released or reused, even when a buggy peer reads after its ack. A zero-copy view
(``read(copy=False)``) is checked once and is valid only until this process acks the handle.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable
from multiprocessing.shared_memory import SharedMemory

import torch

from walkserve.runtime.shm import (
    DATA_OFFSET,
    HEADER,
    LAYOUT_VERSION,
    MAGIC,
    InvalidHandle,
    ShmHandle,
    ShmPoolSpec,
    StaleHandle,
    close_quietly,
    read_state,
)
from walkserve.runtime.tensorcodec import from_bytes

__all__ = ["ShmReader"]


class _Mapping:
    """A read-write mapping of one segment that is not registered with the resource tracker:
    the owner alone decides when a segment is unlinked."""

    def __init__(self, name: str) -> None:
        if sys.version_info >= (3, 13):
            shm = SharedMemory(name=name, track=False)
            self.buf = shm.buf
            self._closer: Callable[[], object] = shm.close
        else:
            # Before 3.13, attaching through SharedMemory registers the segment with this
            # process's resource tracker, which then unlinks it (with a warning) when this
            # process exits, or logs KeyErrors if the tracker is shared with the owner.
            import _posixshmem

            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self.buf = memoryview(mm)

            def unmap() -> None:
                self.buf.release()
                mm.close()

            self._closer = unmap

    def close(self) -> None:
        close_quietly(self._closer)


class ShmReader:
    """A process's read side: attaches to segments named in specs the owner sent, validates
    every handle against the segment itself, and copies tensors out."""

    def __init__(self, specs: Iterable[ShmPoolSpec] = ()) -> None:
        self._specs: dict[str, ShmPoolSpec] = {}
        self._maps: dict[tuple[str, int], _Mapping] = {}
        self._lock = threading.Lock()
        for spec in specs:
            self.add(spec)

    def add(self, spec: ShmPoolSpec) -> None:
        self._specs[spec.pool_id] = spec

    def forget(self, pool_id: str) -> None:
        """Stop reading pool ``pool_id`` (its owner died) and unmap its segments."""
        with self._lock:
            self._specs.pop(pool_id, None)
            for key in [k for k in self._maps if k[0] == pool_id]:
                self._maps.pop(key).close()

    def read(self, handle: ShmHandle, *, copy: bool = True) -> torch.Tensor:
        """The tensor ``handle`` names. ``copy=True``: a new tensor, safe to keep after the
        ack. ``copy=False``: a zero-copy view into the slot, valid only until this reader
        acks the handle (the slot is then reused). Raises ``InvalidHandle``/``StaleHandle``."""
        buf = self._segment(handle)
        tensor = from_bytes(handle.header, self._payload(handle, buf), copy=copy)
        if copy:
            self._check_unchanged(handle, buf)
        return tensor

    def read_into(self, handle: ShmHandle, out: torch.Tensor) -> torch.Tensor:
        """Copy the tensor ``handle`` names into ``out`` (same dtype and shape, any device or
        strides: a static input buffer, a CUDA tensor) and return ``out``. Saves ``read``'s
        allocation, which for large tensors costs more than the copy (fresh pages fault in)."""
        header = handle.header
        if out.dtype != header.torch_dtype or tuple(out.shape) != header.shape:
            have, want = f"{out.dtype}{list(out.shape)}", f"{header.dtype}{list(header.shape)}"
            raise ValueError(f"out is {have}, handle holds {want}")
        buf = self._segment(handle)
        out.copy_(from_bytes(header, self._payload(handle, buf), copy=False))
        self._check_unchanged(handle, buf)
        return out

    def close(self) -> None:
        """Unmap every segment (tensors still viewing one keep it mapped until they die)."""
        with self._lock:
            for mapping in self._maps.values():
                mapping.close()
            self._maps.clear()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _segment(self, handle: ShmHandle) -> memoryview:
        """The mapped segment ``handle`` names, after checking the handle against the spec
        and the segment's own header."""
        spec = self._specs.get(handle.pool_id)
        if spec is None:
            raise InvalidHandle(f"unknown pool {handle.pool_id!r}")
        if not 0 <= handle.index < len(spec.segments):
            raise InvalidHandle(
                f"segment index {handle.index} out of range for pool {spec.pool_id} "
                f"({len(spec.segments)} segments)"
            )
        seg = spec.segments[handle.index]
        if handle.header.nbytes > seg.capacity:
            raise InvalidHandle(
                f"handle says {handle.header.nbytes} bytes, segment {handle.index} holds at "
                f"most {seg.capacity}"
            )
        key = (spec.pool_id, handle.index)
        with self._lock:
            mapping = self._maps.get(key)
            if mapping is None:
                try:
                    mapping = _Mapping(seg.name)
                except FileNotFoundError as e:
                    raise InvalidHandle(f"segment {handle.index} does not exist") from e
                self._maps[key] = mapping
        buf = mapping.buf
        if len(buf) < DATA_OFFSET + seg.capacity:
            raise InvalidHandle(f"segment {handle.index} is smaller than its spec says")
        magic, version, _, _, capacity, _ = HEADER.unpack_from(buf, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or capacity != seg.capacity:
            raise InvalidHandle(f"segment {handle.index} does not hold a walkserve slot")
        return buf

    def _payload(self, handle: ShmHandle, buf: memoryview) -> memoryview:
        """The slot's tensor bytes, after checking that the slot still holds ``handle``'s."""
        gen, nbytes = read_state(buf)
        if gen != handle.generation:
            raise StaleHandle(
                f"slot {handle.index} is at generation {gen}, handle has {handle.generation}"
            )
        if nbytes != handle.header.nbytes:
            raise InvalidHandle(
                f"handle says {handle.header.nbytes} bytes, slot {handle.index} holds {nbytes}"
            )
        return buf[DATA_OFFSET : DATA_OFFSET + nbytes]

    def _check_unchanged(self, handle: ShmHandle, buf: memoryview) -> None:
        """After a copy: the slot was not released (and maybe reused) while we copied."""
        if read_state(buf)[0] != handle.generation:
            raise StaleHandle(f"slot {handle.index} was released while it was being read")
