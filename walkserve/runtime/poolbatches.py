"""The worker pool's node batches: ``submit_batch`` encodes a batch's inputs (small tensors
inline, large ones into the conductor's shared-memory pool), registers its future and sends
``RunBatch``; the io thread completes it from ``BatchDone`` or ``BatchFailed`` and releases
the input slots as the worker acks them (at the latest with its reply, or its death).
``WorkerPool`` (``runtime.pool``) is a ``NodeBatches``."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from walkserve.runtime.messages import (
    Ack,
    BatchDone,
    BatchFailed,
    BatchItem,
    RunBatch,
    Value,
    encode,
)
from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.poolregions import RegionTraffic
from walkserve.runtime.poolremote import RemoteRanks
from walkserve.runtime.poolstate import (
    GONE,
    BatchError,
    BatchResult,
    Item,
    Pending,
    RankState,
    WorkerDied,
    WorkerError,
    WorkerPoolClosed,
    describe_exit,
    fail_future,
    unreachable,
)
from walkserve.runtime.shm import (
    ShmError,
)
from walkserve.runtime.transport import (
    Token,
    TransportError,
    shm_handles,
)

log = logging.getLogger("walkserve.pool")


class NodeBatches(RemoteRanks):
    """The node-batch half of ``WorkerPool`` (see the module docstring)."""

    # the pool's state these methods use (set by WorkerPool.__init__)
    regions: RegionTraffic
    _lock: threading.Lock
    _pending: dict[int, Pending]
    _handle_batch: dict[Token, int]
    _batch_ids: Iterator[int]

    def submit_batch(
        self,
        rank: int,
        walk: str,
        node: str,
        items: Iterable[Item],
        ops: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
    ) -> Future[BatchResult]:
        """Run ``node`` of ``walk`` on ``rank`` for ``items`` (item id, request id, inputs by
        name: tensors, Python scalars, None, tuples/lists of them, or ``ObjectRef`` handles a
        worker returned). ``ops``/``outputs``: part of the node, and the values to return
        (see ``messages.RunBatch``). The future fails with ``BatchError`` (the node raised),
        ``WorkerDied`` or ``WorkerPoolClosed``."""
        state = self._rank(rank)
        future: Future[BatchResult] = Future()
        batch_items: list[BatchItem] = []
        handles: list[Token] = []
        seen: set[int] = set()
        try:
            for item, request_id, inputs in items:
                if item in seen:
                    raise ValueError(f"item id {item} appears twice in one batch")
                seen.add(item)
                values: dict[str, Value] = {}
                for name, value in inputs.items():
                    values[name] = payload = self._transport_for(rank).send(value, request_id)
                    handles += shm_handles(payload)
                batch_items.append(BatchItem(item, request_id, values))
            batch = next(self._batch_ids)
            data = encode(
                RunBatch(
                    batch,
                    walk,
                    node,
                    batch_items,
                    None if ops is None else list(ops),
                    None if outputs is None else list(outputs),
                )
            )
            with self._lock:
                if self._closed:
                    raise WorkerPoolClosed("the worker pool is closed", rank)
                if state.status in GONE:
                    raise WorkerDied(
                        f"worker rank {rank} is dead ({describe_exit(state.exitcode)})", rank
                    )
                self._pending[batch] = Pending(
                    rank,
                    walk,
                    node,
                    [i.item for i in batch_items],
                    future,
                    set(handles),
                    {i.item: i.request_id for i in batch_items},
                )
                for h in handles:
                    self._handle_batch[h] = batch
        except WorkerDied as e:
            self._transport_for(rank).release(handles)
            future.set_exception(e)
            return future
        except BaseException:
            self._transport_for(rank).release(handles)
            raise
        try:
            self._send(state, data)
        except zmq.ZMQError as e:  # its socket is gone (dead) or its queue is full
            pending = self._take(batch)
            if pending is not None:
                error = WorkerDied(unreachable(state, e), rank)
                fail_future(pending.future, error)
        return future

    def _on_ack(self, state: RankState, msg: Ack) -> None:
        with self._lock:
            for h in msg.handles:
                if h in self.regions._region_handles:
                    del self.regions._region_handles[h]
                    self._release(h)
                    continue
                batch = self._handle_batch.pop(h, None)
                pending = self._pending.get(batch) if batch is not None else None
                if pending is None or pending.rank != state.rank or h not in pending.handles:
                    log.warning("rank %d acked a handle it was not given", state.rank)
                    continue
                pending.handles.discard(h)
                self._release(h)

    def _on_done(self, state: RankState, msg: BatchDone) -> None:
        handles = [h for out in msg.outputs for v in out.values.values() for h in shm_handles(v)]
        pending = self._take(msg.batch, state.rank)
        try:
            if pending is None:
                return
            outputs: dict[int, dict[str, Any]] = {}
            for out in msg.outputs:
                outputs[out.item] = {
                    name: self._transport_for(state.rank).receive(payload, "")[0]
                    for name, payload in out.values.items()
                }
                self.regions.track(outputs[out.item], pending.requests.get(out.item, ""))
        except Exception as e:
            assert pending is not None
            error = f"outputs of batch {msg.batch} from rank {state.rank} are unreadable: {e}"
            fail_future(pending.future, WorkerError(error, state.rank))
            return
        finally:
            if handles:  # copied out (or unreadable): the worker may reuse the slots
                with contextlib.suppress(zmq.ZMQError):
                    self._send(state, encode(Ack(handles)))
        answered = sorted([*outputs, *msg.deferred, *(e.item for e in msg.errors)])
        if answered != sorted(pending.items):
            error = f"rank {state.rank} answered items {answered}, sent {sorted(pending.items)}"
            fail_future(pending.future, WorkerError(error, state.rank))
            return
        errors = {e.item: e.error for e in msg.errors}
        pending.future.set_result(
            BatchResult(
                pending.rank,
                pending.walk,
                pending.node,
                outputs,
                frozenset(msg.deferred),
                errors,
            )
        )

    def _on_failed(self, state: RankState, msg: BatchFailed) -> None:
        pending = self._take(msg.batch, state.rank)
        if pending is not None:
            errors = {e.item: e.error for e in msg.errors}
            fail_future(
                pending.future, BatchError(pending.rank, pending.walk, pending.node, errors)
            )

    def _take(self, batch: int, rank: int | None = None) -> Pending | None:
        """Take batch ``batch`` out of the pending table and release the input slots its
        worker did not ack (it is done with them once it replied, or dead)."""
        with self._lock:
            pending = self._pending.get(batch)
            if pending is None or (rank is not None and pending.rank != rank):
                log.warning("reply for unknown batch %d", batch)
                return None
            del self._pending[batch]
            for h in pending.handles:
                self._handle_batch.pop(h, None)
                self._release(h)
            pending.handles.clear()
        return pending

    def _release(self, handle: Token) -> None:
        try:
            if isinstance(handle, MooncakeHandle):
                self._remote_transport.release([handle])
            else:
                self._transport.release([handle])
        except (ShmError, TransportError) as e:
            log.warning("could not release an input slot: %s", e)
