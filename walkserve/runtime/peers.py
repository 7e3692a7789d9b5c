"""Rank to rank: a consumer pulls a held value straight from the rank that made it.

Owns each worker's peer listener (a Unix socket its ``PeerServer`` thread answers on, one
``ranklink.Link`` per consumer rank that connected) and the client side (``PeerClient``: one
link per producer rank). What crosses the boundary: ``Fetch`` / ``Fetched`` / ``Ack`` messages
(typed, never pickle) and tensor bytes in the producer's own shared-memory pool; the server
process carries only the ``ObjectRef`` that names the value::

    rank 0 (made x)                          server                    rank 1 (reads x)
    store[x] = tensor  -- ObjectRef(0, x) -->  conductor  -- RunBatch -->  engine thread:
    PeerServer    <------------------- Fetch(seq, request, [x]) -------------  PeerClient
      pool.write  ------------------- Fetched(seq, [ShmHandle]) ------------>  copy out
      pool.ack    <------------------- Ack([handle]) ------------------------

The peer thread answers from the store and waits on nothing but the asking consumer taking its
answer (which it is reading for), so two ranks fetching from each other cannot deadlock. A
value that is not a tensor (a cache object) is refused: objects never leave their process.
Shared-memory slots a consumer was given and had not acknowledged when its link closed (it
died) are released then; a fetch waiting on a producer whose link closes (it died) fails then,
not at its timeout. Peer sockets are files in the server's private (0700) directory (the
ranks it spawned, on its host), each a rank link as the conductor's (``runtime.ranklink``: a
length-framed Unix stream socket, no ZeroMQ I/O thread on either side: a 1 KiB fetch from an
idle rank took 234 us p50 over ZeroMQ's DEALER and ROUTER, 103 us over a link; 256 KiB ~390 us
and ~280 us). Across hosts a consumer reads a held tensor with one Mooncake read of the block
its producer exported (``ObjectRef.at``), with no socket of this module (``workerinbox``;
``PoolConfig.remote_data``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from walkserve.runtime.ranklink import Link, LinkClosed, LinkListener

if TYPE_CHECKING:
    from walkserve.runtime.shm import ShmPool
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.transport import ObjectStore
    from walkserve.runtime.wirevalues import ObjectRef

log = logging.getLogger("walkserve.peers")

__all__ = ["PeerClient", "PeerError", "PeerServer", "peer_address"]

SEND_TIMEOUT_S = 10.0  # an answer the consumer does not read for this long: its link is dropped


class PeerError(RuntimeError):
    """A held value could not be fetched from the rank that holds it."""


def peer_address(directory: str, rank: int) -> str:
    """Where ``rank``'s peer listener is (a Unix socket path in the pool's directory)."""
    return f"{directory}/peer-{rank}"


class PeerServer:
    """Answers ``Fetch`` on the Unix socket ``path`` from ``objects`` (a thread of its own)."""

    def __init__(
        self,
        path: str,
        objects: ObjectStore,
        pool: ShmPool,
        reader: ShmReader,
        inline_max_bytes: int,
    ) -> None:
        from walkserve.runtime.transport import ShmTransport

        with contextlib.suppress(FileNotFoundError):  # a restarted rank's: its process ended
            os.unlink(path)
        self._listener = LinkListener(path)
        self._objects = objects
        self._pool = pool
        # Writes into this worker's own pool; reads nothing (consumers ack over their link).
        self._transport = ShmTransport(pool, reader, inline_max_bytes=inline_max_bytes)
        self._links: dict[int, Link] = {}  # fd -> a consumer's link
        # fd -> slots given over it and not acked yet, by (pool, index, generation)
        self._given: dict[int, dict[tuple[str, int, int], Any]] = {}
        self._poll = select.poll()
        self._poll.register(self._listener.fileno(), select.POLLIN)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="walkserve-peer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        for fd in list(self._links):
            self._drop(fd)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            for fd, _ in self._poll.poll(100):
                if fd == self._listener.fileno():
                    self._accept()
                    continue
                if fd not in self._links:
                    continue
                try:
                    self._read(fd)
                except Exception:  # a bug of ours: that consumer's link goes, the others stay
                    log.exception("peer: a consumer's message failed; its link is dropped")
                    self._drop(fd)

    def _accept(self) -> None:
        while (accepted := self._listener.accept()) is not None:
            link, _ = accepted
            self._links[link.fileno()] = link
            self._given[link.fileno()] = {}
            self._poll.register(link.fileno(), select.POLLIN)

    def _read(self, fd: int) -> None:
        from walkserve.runtime.messages import Ack, Fetch, MessageError, decode

        link = self._links[fd]
        for data in link.recv():
            try:
                msg = decode(data)
            except MessageError as e:
                log.warning("peer: ignoring a bad message: %s", e)
                continue
            if isinstance(msg, Fetch):
                try:
                    self._answer(fd, link, msg)
                except (LinkClosed, TimeoutError) as e:
                    log.warning("peer: a consumer's link is gone (%s)", e)
                    link.closed = True
                    break
            elif isinstance(msg, Ack):
                given = self._given[fd]
                for handle in msg.handles:
                    if given.pop(_slot(handle), None) is None:
                        log.warning("peer: an ack of a slot not given over this link")
                        continue
                    self._release([handle])
        if link.closed:  # the consumer's process ended: what it held of ours is free again
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        link = self._links.pop(fd, None)
        if link is None:
            return
        given = self._given.pop(fd)
        self._poll.unregister(fd)
        link.close()
        if given:
            self._release(list(given.values()))

    def _release(self, handles: list[Any]) -> None:
        try:
            self._transport.release(handles)
        except Exception as e:  # the thread goes on answering the other consumers
            log.warning("peer: a slot could not be released: %s", e)

    def _answer(self, fd: int, link: Link, msg: Any) -> None:
        import torch

        from walkserve.runtime.messages import Fetched, encode
        from walkserve.runtime.transport import shm_handles
        from walkserve.runtime.wirevalues import ObjectRef

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
            values, written, error = [], [], str(e)
        pool = self._pool.spec if written else None
        self._given[fd].update((_slot(h), h) for h in written)
        link.send_all(encode(Fetched(msg.seq, values, error, pool)), SEND_TIMEOUT_S)


def _slot(handle: Any) -> tuple[str, int, int]:
    return handle.pool_id, handle.index, handle.generation


class PeerClient:
    """Fetches held values from other ranks (``peers``: rank -> its peer socket's path); used
    by one thread at a time (the worker's engine thread)."""

    def __init__(
        self,
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
        self._on_wait = on_wait
        self._slice_ms = max(1, int(wait_slice_s * 1000))
        self.rank = rank
        self.peers = peers
        self._reader = reader
        self._timeout_s = timeout_s
        self._links: dict[int, Link] = {}
        self._attached: dict[int, str] = {}  # rank -> the pool of its answers
        self._seq = itertools.count()
        self.bytes_in = 0

    def close(self) -> None:
        for link in self._links.values():
            link.close()

    def fetch(self, request_id: str, refs: Iterable[ObjectRef]) -> dict[tuple[int, str], Any]:
        """The values of ``refs`` held by other ranks, by (rank, key): one round trip per rank."""
        from walkserve.runtime.messages import Ack, Fetch, encode
        from walkserve.runtime.shm import ShmHandle
        from walkserve.runtime.transport import from_inline, shm_handles
        from walkserve.runtime.wirevalues import Inline

        by_rank: dict[int, list[str]] = {}
        for ref in refs:
            if ref.rank != self.rank:
                by_rank.setdefault(ref.rank, []).append(ref.key)
        out: dict[tuple[int, str], Any] = {}
        for rank, keys in by_rank.items():
            reply = self._ask(rank, Fetch(next(self._seq), request_id, keys))
            link = self._links[rank]
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
                try:
                    link.send_all(encode(Ack(handles)), self._timeout_s)
                except (LinkClosed, TimeoutError):  # it ended: its slots went with it
                    self._forget(rank)
        return out

    def _ask(self, rank: int, fetch: Any) -> Any:
        """Send ``fetch`` to ``rank`` and wait for its answer. A link kept from before that
        turns out closed (the rank was restarted since) is replaced once: the new process
        answers (its values are its own: a key of the old one is unknown to it)."""
        from walkserve.runtime.messages import encode

        data = encode(fetch)
        while True:
            fresh = rank not in self._links
            link = self._link(rank)
            try:
                link.send_all(data, self._timeout_s)
                return self._reply(rank, link, fetch.seq)
            except LinkClosed as e:
                self._forget(rank)
                if fresh:
                    raise PeerError(f"rank {rank} did not answer a fetch: {e}") from e
            except TimeoutError as e:
                self._forget(rank)
                raise PeerError(f"rank {rank} did not answer a fetch: {e}") from e

    def _reply(self, rank: int, link: Link, seq: int) -> Any:
        """The ``Fetched`` answering ``seq`` (an older fetch's late answer is skipped)."""
        from walkserve.runtime.messages import Fetched, decode

        deadline = time.monotonic() + self._timeout_s
        while True:
            while not link.waiting(self._slice_ms):
                self._on_wait()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer in {self._timeout_s:.0f} s")
            for data in link.recv():
                msg = decode(data)
                if isinstance(msg, Fetched) and msg.seq == seq:
                    return msg  # one fetch at a time: nothing follows its answer
            if link.closed:
                raise LinkClosed(f"rank {rank} closed its peer link (its process ended)")

    def _link(self, rank: int) -> Link:
        link = self._links.get(rank)
        if link is None:
            path = self.peers.get(rank)
            if path is None:
                raise PeerError(f"rank {rank} has no peer socket: values cannot come from it")
            try:
                link = self._links[rank] = Link.connect(path)
            except OSError as e:
                raise PeerError(f"rank {rank}'s peer socket cannot be reached: {e}") from e
        return link

    def _forget(self, rank: int) -> None:
        """Its link broke (the rank ended or answers nothing): the next fetch connects anew."""
        link = self._links.pop(rank, None)
        if link is not None:
            link.close()
