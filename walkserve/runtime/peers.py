"""Rank to rank: a consumer pulls a held value straight from the rank that made it.

Owns each worker's peer socket (a ROUTER its ``PeerServer`` thread answers on) and the client
side (``PeerClient``: one DEALER per producer rank). What crosses the boundary: ``Fetch`` /
``Fetched`` / ``Ack`` messages (typed, never pickle) and tensor bytes in the producer's own
shared-memory pool; the server process carries only the ``ObjectRef`` that names the value::

    rank 0 (made x)                          server                    rank 1 (reads x)
    store[x] = tensor  -- ObjectRef(0, x) -->  conductor  -- RunBatch -->  engine thread:
    PeerServer    <------------------- Fetch(seq, request, [x]) -------------  PeerClient
      pool.write  ------------------- Fetched(seq, [ShmHandle]) ------------>  copy out
      pool.ack    <------------------- Ack([handle]) ------------------------

The peer thread answers from the store and never waits on anything else, so two ranks
fetching from each other cannot deadlock. A value that is not a tensor (a cache object) is
refused: objects never leave their process. Peer sockets are ``ipc://`` files in the server's
private directory (the ranks it spawned, on its host). Across hosts a consumer reads a held
tensor with one Mooncake read of the block its producer exported (``ObjectRef.at``), with no
socket of this module (``workerinbox``; ``PoolConfig.remote_data``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq

    from walkserve.runtime.messages import ObjectRef
    from walkserve.runtime.shm import ShmPool
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.transport import ObjectStore

log = logging.getLogger("walkserve.peers")

__all__ = ["PeerClient", "PeerError", "PeerServer", "peer_address"]


class PeerError(RuntimeError):
    """A held value could not be fetched from the rank that holds it."""


def peer_address(directory: str, rank: int) -> str:
    return f"ipc://{directory}/peer-{rank}"


class PeerServer:
    """Answers ``Fetch`` on ``address`` from ``objects`` (a thread of its own)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        objects: ObjectStore,
        pool: ShmPool,
        reader: ShmReader,
        inline_max_bytes: int,
    ) -> None:
        import zmq

        from walkserve.runtime.transport import ShmTransport

        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._objects = objects
        self._pool = pool
        # Writes into this worker's own pool; reads nothing (consumers ack over the socket).
        self._transport = ShmTransport(pool, reader, inline_max_bytes=inline_max_bytes)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="walkserve-peer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._sock.close(linger=0)

    def _serve(self) -> None:
        from walkserve.runtime.messages import Ack, Fetch, MessageError, decode

        while not self._stopping.is_set():
            if not self._sock.poll(100):
                continue
            ident, data = self._sock.recv_multipart()
            try:
                msg = decode(data)
            except MessageError as e:
                log.warning("peer: ignoring a bad message: %s", e)
                continue
            if isinstance(msg, Fetch):
                self._answer(ident, msg)
            elif isinstance(msg, Ack):
                for handle in msg.handles:
                    try:
                        self._transport.release([handle])
                    except Exception as e:
                        log.warning("peer: bad ack: %s", e)

    def _answer(self, ident: bytes, msg: Any) -> None:
        import torch

        from walkserve.runtime.messages import Fetched, ObjectRef, encode
        from walkserve.runtime.transport import shm_handles

        values: list[Any] = []
        error = None
        written: list[Any] = []
        try:
            for key in msg.keys:
                value = self._objects.get(msg.request_id, ObjectRef(self._objects.rank, key))
                if not isinstance(value, torch.Tensor):
                    raise PeerError(
                        f"a {type(value).__name__} held on rank {self._objects.rank} cannot "
                        "leave its process: place its producer and consumers on one rank"
                    )
                payload = self._transport.send(value, msg.request_id)
                written += shm_handles(payload)
                values.append(payload)
        except Exception as e:
            self._transport.release(written)
            values, error = [], str(e)
        pool = self._pool.spec if written else None
        self._sock.send_multipart([ident, encode(Fetched(msg.seq, values, error, pool))])


class PeerClient:
    """Fetches held values from other ranks (``peers``: rank -> peer address); used by one
    thread at a time (the worker's engine thread)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        rank: int,
        peers: dict[int, str],
        reader: ShmReader,
        timeout_s: float = 60.0,
        on_wait: Callable[[], object] = lambda: None,
        wait_slice_s: float = 0.1,
    ) -> None:
        """``on_wait``: called every ``wait_slice_s`` while an answer is awaited (a caller
        whose heartbeats run on its own thread keeps them going; a worker's run on its watch
        thread)."""
        self._ctx = ctx
        self._on_wait = on_wait
        self._slice_ms = max(1, int(wait_slice_s * 1000))
        self.rank = rank
        self.peers = peers
        self._reader = reader
        self._timeout_ms = int(timeout_s * 1000)
        self._socks: dict[int, zmq.Socket[bytes]] = {}
        self._attached: dict[int, str] = {}  # rank -> the pool of its answers
        self._seq = itertools.count()
        self.bytes_in = 0

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)

    def fetch(self, request_id: str, refs: Iterable[ObjectRef]) -> dict[tuple[int, str], Any]:
        """The values of ``refs`` held by other ranks, by (rank, key): one round trip per rank."""
        from walkserve.runtime.messages import Ack, Fetch, Fetched, Inline, decode, encode
        from walkserve.runtime.shm import ShmHandle
        from walkserve.runtime.transport import from_inline, shm_handles

        by_rank: dict[int, list[str]] = {}
        for ref in refs:
            if ref.rank != self.rank:
                by_rank.setdefault(ref.rank, []).append(ref.key)
        out: dict[tuple[int, str], Any] = {}
        for rank, keys in by_rank.items():
            sock = self._socket(rank)
            seq = next(self._seq)
            sock.send(encode(Fetch(seq, request_id, keys)))
            reply = None
            deadline = time.monotonic() + self._timeout_ms / 1000
            while reply is None:
                while not sock.poll(self._slice_ms):
                    self._on_wait()
                    if time.monotonic() > deadline:
                        raise PeerError(f"rank {rank} did not answer a fetch in time")
                msg = decode(sock.recv())
                if isinstance(msg, Fetched) and msg.seq == seq:
                    reply = msg
            if reply.error is not None:
                raise PeerError(f"rank {rank}: {reply.error}")
            if reply.pool is not None and self._attached.get(rank) != reply.pool.pool_id:
                old = self._attached.get(rank)
                if old is not None:  # the rank was restarted: its old pool is gone
                    self._reader.forget(old)
                self._reader.add(reply.pool)
                self._attached[rank] = reply.pool.pool_id
            handles = []
            for key, payload in zip(keys, reply.values):
                if isinstance(payload, Inline):
                    value = from_inline(payload)
                elif isinstance(payload, ShmHandle):
                    value = self._reader.read(payload)
                    handles += shm_handles(payload)
                else:
                    raise PeerError(f"rank {rank} answered with a {type(payload).__name__}")
                self.bytes_in += value.numel() * value.element_size()
                out[(rank, key)] = value
            if handles:
                sock.send(encode(Ack(handles)))
        return out

    def _socket(self, rank: int) -> zmq.Socket[bytes]:
        import zmq

        sock = self._socks.get(rank)
        if sock is None:
            address = self.peers.get(rank)
            if address is None:
                raise PeerError(f"rank {rank} has no peer socket: values cannot come from it")
            sock = self._socks[rank] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock
