"""Transports: how a value one process produced reaches the process that reads it.

Owns the data plane's value encoding and its lifetime rule; the control plane (ZeroMQ, typed
messages) carries only what ``send`` returns. Every transport has the same three steps::

    payload = producer.send(value, request_id)          # value -> what travels
    value, tokens = consumer.receive(payload, request_id)
    producer.release(tokens)                             # after the consumer said it is done

``ShmTransport`` (one host): a tensor under ``inline_max_bytes`` travels inline in the message;
a larger one is copied once into the producer's ``ShmPool`` and travels as an ``ShmHandle``
(inline too when every slot of its size is held: a full pool slows a message, never fails it);
the consumer copies it out and sends the handle back in an ``Ack``, whose handles are the
``tokens`` the producer releases. Python scalars and None travel as themselves, tuples, lists
and ``torch.Size`` as ``Seq``. A value none of these fit (a Hugging Face cache object, a dict)
is kept in the producer's ``ObjectStore`` and travels as an ``ObjectRef``: objects never cross
a process boundary, so a plan must place an object's producer and all its consumers on one
rank; any other rank fails the batch with an error that says so.

``LocalTransport`` (producer and consumer share a process): the payload *is* the value, no copy
and nothing to release; the consumer sees the producer's object, as in eager execution.

Payloads are pulled: ``send`` needs no destination, because whoever receives the payload
reads the bytes (one host: copies them out of the producer's segment). The control plane
decides where a payload goes; ``WorkerPool.submit_batch(rank, ...)`` sends to a rank.

A network transport plugs in as a third ``Transport`` (``runtime.net.mooncake``): ``send``
registers the tensor with the transfer engine and returns a new tagged handle struct added to
``messages.Value`` (segment, offset, ``TensorHeader``); ``receive`` reads it from the remote
host into a local tensor (an RDMA read) and returns the handle as its token; ``release`` frees
the registered buffer when the handle comes back in an ``Ack``. Apart from building it, the
workers and the pool only call these three methods and ``shm_handles`` (which becomes "the
tokens a payload holds"), so nothing else above this module changes; ``WorkerSetup.pool``
becomes that transport's attach information (the engine's segment names), sent the same way.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from walkserve.runtime.config import INLINE_MAX_BYTES
from walkserve.runtime.messages import Value
from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.shm import PoolExhausted, ShmHandle, ShmPool
from walkserve.runtime.shmreader import ShmReader
from walkserve.runtime.tensorcodec import DTYPES, TensorHeader, to_bytes
from walkserve.runtime.wirevalues import Inline, ObjectRef, Seq

_INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries


class TransportError(ValueError):
    """A payload this process cannot turn into a value (an object of another rank, an
    object key its request does not own)."""


class Unencodable(TypeError):
    """A value with no wire form and no object store to keep it in."""


# -------------------------------------------------------------------------- interface


class Transport(ABC):
    """Moves values from a producer to a consumer; see the module docstring."""

    @abstractmethod
    def send(self, value: Any, request_id: str) -> Any:
        """The payload that carries ``value`` (produced for ``request_id``) to one consumer.
        Resources it holds stay held until the consumer's tokens come back to ``release``."""

    @abstractmethod
    def receive(self, payload: Any, request_id: str) -> tuple[Any, list[Any]]:
        """The value ``payload`` carries, and the tokens to hand back to its producer."""

    @abstractmethod
    def release(self, tokens: Sequence[Any]) -> None:
        """The consumer is done with these tokens (from ``receive``); free what they hold."""


class LocalTransport(Transport):
    """In-process fast path: no encoding, no copy, nothing to release."""

    def send(self, value: Any, request_id: str) -> Any:
        return value

    def receive(self, payload: Any, request_id: str) -> tuple[Any, list[Any]]:
        return payload, []

    def release(self, tokens: Sequence[Any]) -> None:
        return None


# ------------------------------------------------------------------------ object store


_GONE = object()


class Exports(Protocol):
    """Where held tensors wait for readers on other hosts (``net.mooncake.SendPool``): ``write``
    a tensor's bytes (None: no room), ``ack`` frees them."""

    def write(self, t: torch.Tensor) -> Any: ...

    def ack(self, handle: Any) -> None: ...


class ObjectStore:
    """A worker's per-request store of the values it keeps where they were made: objects
    that cannot leave its process, and tensors no one needs the bytes of elsewhere.

    ``put`` keeps a value for a request and returns its ``ObjectRef`` (a fresh key for every
    put: each reference the conductor holds is released on its own); ``get`` resolves a
    reference only for the request that made it and only on this rank; ``release`` drops keys
    whose last reader is done; ``drop`` forgets all values of a request (on ``Cancel``: the
    request finished, failed or was aborted).

    A dropped request stays dropped: a value a late step makes for it (a speculative step still
    running when the request ended) is not kept, so nothing outlives its request. Thread-safe:
    the receive and peer threads resolve while the run thread stores.

    ``exports`` (ranks on several hosts): ``hold`` also writes a held tensor where readers on
    other hosts pull it from (a block of this process's Mooncake send buffer; the reference's
    ``at``), and the block is freed when its key is released or its request dropped."""

    def __init__(
        self,
        rank: int,
        max_per_request: int = 4096,
        remember_dropped: int = 65536,
        exports: Exports | None = None,
    ):
        self.rank = rank
        self.max_per_request = max_per_request
        self.exports = exports
        self._exported: dict[tuple[str, str], Any] = {}  # (request, key) -> its export
        self.exports_written = 0  # tensors written to ``exports`` so far, and their bytes
        self.bytes_exported = 0
        self._objects: dict[str, dict[str, Any]] = {}
        self._dropped: dict[str, None] = {}  # insertion-ordered, bounded
        self._remember_dropped = remember_dropped
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def put(self, request_id: str, obj: Any) -> ObjectRef:
        """Keep ``obj`` for ``request_id``: its reference (readable here and, for a tensor, by
        the ranks of this host)."""
        return self._put(request_id, obj, None)

    def hold(self, request_id: str, tensor: torch.Tensor, export: bool = True) -> ObjectRef | None:
        """``put`` of a tensor that readers on other ranks may pull: with ``exports`` and
        ``export`` (a reader may be on another host), its bytes are written there too
        (``at``); None when they cannot be (no room): send its bytes instead."""
        if self.exports is None or not export:
            return self._put(request_id, tensor, None)
        at = self.exports.write(tensor)
        if at is None:
            return None
        self.exports_written += 1
        self.bytes_exported += tensor.numel() * tensor.element_size()
        try:
            ref = self._put(request_id, tensor, at)
        except BaseException:  # too many held for the request: nothing stays exported
            self.exports.ack(at)
            raise
        if ref.at is None:  # not kept (a dropped request's)
            self.exports.ack(at)
        return ref

    def _put(self, request_id: str, obj: Any, at: Any) -> ObjectRef:
        shape = None
        if isinstance(obj, torch.Tensor):
            shape = list(obj.shape)
            if obj.untyped_storage().nbytes() > obj.numel() * obj.element_size():
                obj = obj.clone()  # a view of a larger block (a cohort's): not kept whole
        with self._lock:
            key = f"o{next(self._keys)}"
            if request_id in self._dropped:
                return ObjectRef(self.rank, key, shape)  # resolves to nothing
            objects = self._objects.setdefault(request_id, {})
            if len(objects) >= self.max_per_request:
                raise TransportError(
                    f"request {request_id} holds {len(objects)} values on rank {self.rank}; "
                    "is it never cancelled?"
                )
            objects[key] = obj
            if at is not None:
                self._exported[(request_id, key)] = at
        return ObjectRef(self.rank, key, shape, at)

    def release(self, request_id: str, keys: Sequence[str]) -> None:
        """Forget ``keys`` of ``request_id`` (unknown keys: nothing)."""
        freed = []
        with self._lock:
            objects = self._objects.get(request_id)
            if objects is None:
                return
            for key in keys:
                if objects.pop(key, _GONE) is not _GONE and self._exported:
                    freed.append(self._exported.pop((request_id, key), None))
            if not objects:
                del self._objects[request_id]
        self._unexport(freed)

    def _unexport(self, exported: Sequence[Any]) -> None:
        if self.exports is not None:
            for at in exported:
                if at is not None:
                    self.exports.ack(at)

    def counters(self) -> dict[str, int]:
        """Exports so far, for a rank's stats (``objects/exported``, ``objects/exported_bytes``)."""
        return {
            "objects/exported": self.exports_written,
            "objects/exported_bytes": self.bytes_exported,
        }

    @property
    def exported(self) -> int:
        """Held tensors whose bytes wait in ``exports`` for readers on other hosts."""
        with self._lock:
            return len(self._exported)

    def get(self, request_id: str, ref: ObjectRef) -> Any:
        if ref.rank != self.rank:
            raise TransportError(
                f"object {ref.key} lives on rank {ref.rank}, not on rank {self.rank}: objects "
                "never cross processes; place its producer and consumers on one rank"
            )
        with self._lock:
            objects = self._objects.get(request_id, {})
            if ref.key not in objects:
                raise TransportError(
                    f"request {request_id} has no object {ref.key} on rank {self.rank}"
                )
            return objects[ref.key]

    def drop(self, request_id: str) -> int:
        """Forget every object of ``request_id``; returns how many there were."""
        with self._lock:
            self._dropped[request_id] = None
            if len(self._dropped) > self._remember_dropped:
                del self._dropped[next(iter(self._dropped))]
            objects = self._objects.pop(request_id, {})
            freed = [self._exported.pop((request_id, k), None) for k in objects]
        self._unexport(freed)
        return len(objects)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._objects.values())


# -------------------------------------------------------------------------------- shm


class ShmTransport(Transport):
    """One host: small tensors inline, large ones through ``pool`` (this process's own),
    received ones read through ``reader`` (attached to the producers' pools).

    ``objects``: where unencodable values go (a worker); without one (the conductor) they
    raise ``Unencodable``, and ``ObjectRef`` payloads are passed through as they are: the
    conductor holds the reference and hands it back to the worker that resolves it."""

    def __init__(
        self,
        pool: ShmPool,
        reader: ShmReader,
        *,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        objects: ObjectStore | None = None,
    ) -> None:
        if inline_max_bytes < 0:
            raise ValueError(f"inline_max_bytes must be >= 0, got {inline_max_bytes}")
        self.pool = pool
        self.reader = reader
        self.inline_max_bytes = inline_max_bytes
        self.objects = objects
        # (rank, key) -> a value another rank holds, fetched before the payload is read
        # (``peers.PeerClient``): only a worker resolves another rank's references.
        self.fetched: dict[tuple[int, str], Any] = {}
        self.bytes_in = 0  # tensor bytes read (inline, shared memory or Mooncake)
        self.exhausted = 0  # tensors sent inline because the pool had no free slot
        self.bytes_out = 0  # tensor bytes written

    def send(self, value: Any, request_id: str) -> Value:
        written: list[ShmHandle] = []
        try:
            return self._pack(value, request_id, written)
        except BaseException:
            self.release(written)
            raise

    def receive(self, payload: Any, request_id: str) -> tuple[Any, list[Any]]:
        tokens: list[ShmHandle] = []
        return self._unpack(payload, request_id, tokens), list(tokens)

    def release(self, tokens: Sequence[Any]) -> None:
        for handle in tokens:
            self.pool.ack(handle)

    # ------------------------------------------------------------------ internals

    def _pack(self, value: Any, request_id: str, written: list[ShmHandle]) -> Value:
        if value is None or isinstance(value, (bool, float, str)):
            return value  # type: ignore[no-any-return]
        if isinstance(value, int) and _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            return value
        if isinstance(value, torch.Tensor) and _encodable(value):
            self.bytes_out += value.numel() * value.element_size()
            if value.numel() * value.element_size() < self.inline_max_bytes:
                return inline(value)
            try:
                handle = self.pool.write(value)
            except PoolExhausted:  # every slot of its size is held: the bytes go inline
                self.exhausted += 1
                return inline(value)
            written.append(handle)
            return handle
        if isinstance(value, ObjectRef) and self.objects is None:
            return value
        kind = _SEQ_KINDS.get(type(value))
        if kind is not None:
            return Seq(kind, [self._pack(v, request_id, written) for v in value])
        if self.objects is None:
            raise Unencodable(
                f"a {type(value).__name__} has no wire form (tensors, scalars, None, tuples "
                "and lists of them); only a worker can keep it, as an object"
            )
        return self.objects.put(request_id, value)

    def _unpack(self, payload: Any, request_id: str, tokens: list[ShmHandle]) -> Any:
        if isinstance(payload, Inline):
            self.bytes_in += payload.header.nbytes
            return from_inline(payload)
        if isinstance(payload, ShmHandle):
            tensor = self.reader.read(payload)
            self.bytes_in += payload.header.nbytes
            tokens.append(payload)
            return tensor
        if isinstance(payload, ObjectRef):
            if self.objects is None:
                return payload
            if payload.rank != self.objects.rank and (payload.rank, payload.key) in self.fetched:
                return self.fetched[(payload.rank, payload.key)]
            return self.objects.get(request_id, payload)
        if isinstance(payload, Seq):
            items = [self._unpack(v, request_id, tokens) for v in payload.items]
            if payload.kind == "list":
                return items
            return tuple(items) if payload.kind == "tuple" else torch.Size(items)
        return payload  # a scalar or None


_SEQ_KINDS: dict[type, Any] = {tuple: "tuple", list: "list", torch.Size: "size"}
_WIRE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _encodable(t: torch.Tensor) -> bool:
    return t.dtype in _WIRE_NAMES and t.layout == torch.strided and not (t.is_nested or t.is_meta)


def inline(t: torch.Tensor) -> Inline:
    """``t`` as an ``Inline``: the bytes ``tensorcodec.to_bytes`` gives, made with one copy
    (no intermediate tensors) when ``t`` is a plain contiguous CPU tensor. Small tensors are
    the common case on the control plane, where per-tensor overhead, not bandwidth, counts."""
    if t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        nbytes = t.numel() * t.element_size()
        header = TensorHeader(_WIRE_NAMES[t.dtype], tuple(t.shape), nbytes)
        return Inline(header, ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b"")
    return Inline(*to_bytes(t))


def from_inline(ref: Inline) -> torch.Tensor:
    """A fresh CPU tensor holding ``ref``'s bytes (what ``tensorcodec.from_bytes`` returns,
    made with one copy into a new tensor)."""
    header = ref.header
    out = torch.empty(header.shape, dtype=header.torch_dtype)
    if header.nbytes:
        ctypes.memmove(out.data_ptr(), ref.data, header.nbytes)
    return out


Token = ShmHandle | MooncakeHandle  # what a consumer acks to a producer


def shm_handles(payload: Any) -> list[Token]:
    """Every ``ShmHandle`` (or ``MooncakeHandle``: the tokens a payload holds) in a payload
    (the slots a consumer will ack)."""
    if isinstance(payload, (ShmHandle, MooncakeHandle)):
        return [payload]
    if isinstance(payload, Seq):
        return [h for v in payload.items for h in shm_handles(v)]
    return []
