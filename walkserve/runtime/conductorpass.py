"""What one conductor pass of the server does: ready work out to the ranks, what comes back
into the conductor, the conductor's events out to the request handles. ``server.Server`` is a
``ConductorPass``; who makes a pass, and when, is ``passes``'s::

    run the queued tasks                         admissions, cancels, replies, region events
    items   = conductor.ready()                  schedule: ready work of every request
    batches = batcher.batches(items, wanted)     by (walk, plan node, ops, rank)
    pool.submit_batch(...) / pool.regions.start  run: one RunBatch per node batch, one
                                                 StartRegions per rank
    pool.regions.drop / feed / grant             region runs no one waits for dropped; streams
                                                 between regions: items fed, credit granted
    wake the admitted callers                    after their request's first dispatch
    route(conductor.events())                    outputs and stream items to their handles;
                                                 the ranks told which requests ended

Replies come back as tasks for the next pass: a node batch's future (``conductor.complete``,
``fail`` or ``defer`` per item), a rank's region events (``streamed``, ``partial``,
``consumed``, ``complete``, ``fail``). Planning overlaps execution: while batches are out on
the workers, each pass keeps taking newly ready items (the next iteration of another request,
another branch) and dispatching them.

A pass never fails silently: an unexpected exception is logged with its traceback and fails
every request the conductor holds (their state may be half updated); ``MAX_FAULTS`` of them
within ``FAULT_WINDOW_S`` stop the server, ``fatal`` saying why.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from walkserve.capture import dataflow, ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.batched import merges_calls
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.batcher import Batch, Batcher
from walkserve.runtime.burst import ADMIT_CHUNK
from walkserve.runtime.conductor import Conductor, Event, Failed, Finished, StreamItem, WorkItem
from walkserve.runtime.handle import RequestHandle, wake_waiters
from walkserve.runtime.messages import (
    RegionConsumed,
    RegionDone,
    RegionOutput,
    RegionStreamed,
)
from walkserve.runtime.passes import Passes
from walkserve.runtime.pool import BatchResult, WorkerPool

__all__ = ["FAULT_WINDOW_S", "MAX_FAULTS", "ConductorPass"]

log = logging.getLogger("walkserve.server")

MAX_FAULTS = 3  # unexpected conductor failures within FAULT_WINDOW_S that stop the server
FAULT_WINDOW_S = 10.0


class ConductorPass:
    """The conductor passes of ``Server`` (see the module docstring)."""

    # the server's state these methods use (set by Server)
    captured: CapturedModel
    plan: ExecutablePlan
    pool: WorkerPool
    conductor: Conductor

    def _open_passes(self, max_inflight: int) -> None:
        """The passes' state, and the pool's hooks into them: the pool's io thread may make
        a pass from now on."""
        captured, plan, pool = self.captured, self.plan, self.pool
        nodes = {(w, n.name): n for w in plan.walks for n in plan.nodes(w)}
        self._ops: dict[str, dict[str, ir.Op]] = {
            w.name: {n.name: n for n in dataflow.iter_nodes(w.body) if isinstance(n, ir.Op)}
            for w in captured.graph.walks.values()
        }
        # what the conductor is to do, run in order by whichever thread makes the next pass
        self._passes = Passes(self._pass, pool)
        self._faults: list[float] = []  # when passes failed unexpectedly, within FAULT_WINDOW_S
        self._admitted: list[Callable[[], None]] = []  # callers to wake after this dispatch
        self._handles: dict[str, RequestHandle] = {}
        self.fatal: str | None = None  # why the conductor stopped, if it did
        # Continuous batching across the nodes the conductor drives (``batcher``): a node
        # whose component runs a batch as one forward (PagedLM: merges_calls) waits while
        # max_inflight of its batches are out on a rank. Regions batch on their rank.
        components = captured.graph.components
        merging = {
            key
            for key, node in nodes.items()
            if merges_calls(node)
            and node.target in components
            and components[node.target].engine == "kv_cache"
        }
        regions = {(w, r.name): r for w, found in plan.regions.items() for r in found}
        self.batcher = Batcher(nodes, regions, merging, max_inflight, alive=pool.serving)
        self._region_rank: dict[int, int] = {}  # region items out -> their rank
        pool.regions.on_regions = self._region_events
        pool.on_io_pass = self._passes.pump

    def _pass(self) -> None:
        """One pass: run the queued tasks, dispatch what is ready, route the events. It never
        fails silently: an unexpected exception is logged with its traceback and fails every
        request the conductor holds (their state may be half updated); ``MAX_FAULTS`` of them
        within ``FAULT_WINDOW_S`` stop the server, ``fatal`` saying why (``/health`` answers
        503, ``walkserve serve`` exits)."""
        try:
            self._admit()
            # the ends and their releases first: a caller woken (admitted) would take the GIL
            # at the releases' send (``_route``)
            self._route(self.conductor.events())
            self._wake_admitted()
        except Exception as e:
            log.exception("a conductor pass failed; failing the requests it held")
            now = time.monotonic()
            self._faults = [t for t in self._faults if now - t < FAULT_WINDOW_S] + [now]
            self._fail_all(f"the server failed: {type(e).__name__}: {e}")
            if len(self._faults) >= MAX_FAULTS:
                self.fatal = f"{type(e).__name__}: {e}"
                log.critical("%d conductor passes failed in a row; stopping", len(self._faults))
                self._fail_all(f"the server stopped: {self.fatal}")
                self._passes.stopped = True

    def _admit(self) -> None:
        """Run the queued tasks and dispatch what they made ready. A burst onto quiet ranks
        (nothing out on any) goes in chunks: ``ADMIT_CHUNK`` tasks at a time while more wait,
        each chunk's region starts sent at once as part of a burst (``burst``: their ranks
        read them while the next chunk is admitted, and step none before the last); the other
        items made ready wait for the last chunk, so that node batches form as they did when
        the whole pass was one chunk. Ranks with work out would not hold a burst (they step
        what they run and the burst joins it): their passes stay one dispatch."""
        if not self.batcher.quiet():
            self._passes.run_tasks()
            self._dispatch(self.conductor.ready())
            return
        held: list[WorkItem] = []
        try:
            while True:
                self._passes.run_tasks(ADMIT_CHUNK)
                ready = held + self.conductor.ready()
                if not self._passes.tasks:
                    self._dispatch(ready)
                    return
                held = [it for it in ready if it.kind != "region"]
                regions = [it for it in ready if it.kind == "region"]
                if regions:
                    self._dispatch(regions, burst=True)
        finally:
            self.pool.regions.end_bursts()

    def _wake_admitted(self) -> None:
        admitted, self._admitted = self._admitted, []
        for wake in admitted:
            wake()

    def _fail_all(self, error: str) -> None:
        """Fail every live request (the conductor's state of each may be inconsistent)."""
        for rid in list(self._handles):
            with contextlib.suppress(Exception):
                self.conductor.cancel(rid)
                self.pool.release_request(rid)
            handle = self._handles.pop(rid)
            handle._finish(error)
        self._wake_admitted()  # their callers get the handles, failed

    def _dispatch(self, items: list[WorkItem], burst: bool = False) -> None:
        """Send ready ``items`` as the batcher groups them (one ``RunBatch`` per node batch,
        one ``StartRegions`` per rank), and tell ranks about region runs no one waits for.
        ``burst``: more region starts of this pass may follow (``_admit``)."""
        for batch in self.batcher.batches(items, self.conductor.wanted):
            if batch.kind == "regions":
                for it in batch.items:
                    self._region_rank[it.id] = batch.rank
                starts = [
                    (it.id, it.request, it.walk, it.node, it.env, it.stream) for it in batch.items
                ]
                try:
                    self.pool.regions.start(batch.rank, starts, burst)
                except Exception:  # an input with no wire form: find it, fail its request
                    for start in starts:
                        try:
                            self.pool.regions.start(batch.rank, [start], burst)
                        except Exception as e:
                            self._region_over(start[0])
                            self.conductor.fail(start[0], f"its inputs could not be sent: {e}")
                continue
            payload = [(it.id, it.request, self._inputs(it)) for it in batch.items]
            try:
                future = self.pool.submit_batch(
                    batch.rank,
                    batch.walk,
                    batch.node,
                    payload,
                    ops=list(batch.ops),
                    outputs=list(batch.outputs),
                )
            except Exception as e:  # an input with no wire form: those requests fail, alone
                self.batcher.returned(batch)
                for it in batch.items:
                    self.conductor.fail(it.id, f"its inputs could not be sent: {e}")
                continue
            future.add_done_callback(self._reply_callback(batch))
        by_rank: dict[int, list[int]] = {}
        for item_id in self.conductor.dropped():
            rank = self._region_over(item_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(item_id)
        for rank, group in by_rank.items():
            self.pool.regions.drop(rank, group)
        self._route_streams()

    def _region_over(self, item: int) -> int | None:
        """Region item ``item`` is over (done, failed, dropped): its rank, which the batcher
        counts one fewer run on."""
        rank = self._region_rank.pop(item, None)
        if rank is not None:
            self.batcher.region_returned(rank)
        return rank

    def _route_streams(self) -> None:
        """Streams between regions: items to consumer regions, credit to producer ones."""
        for feed in self.conductor.feeds():
            rank = self._region_rank.get(feed.item)
            if rank is not None:
                self.pool.regions.feed(
                    rank, feed.item, feed.request, feed.stream, feed.pieces, feed.finished
                )
        for credit in self.conductor.credits():
            rank = self._region_rank.get(credit.item)
            if rank is not None:
                self.pool.regions.grant(rank, credit.item, credit.channel, credit.items)

    def _reply_callback(self, batch: Batch) -> Any:
        def on_reply(future: Future[BatchResult]) -> None:
            def finished() -> None:
                self.batcher.returned(batch)
                self._finished(future, list(batch.items))

            self._passes.post(finished)

        return on_reply

    def _region_events(self, rank: int, events: list[Any]) -> None:
        """From the pool's io thread: hand a rank's region events to the loop thread."""

        def apply() -> None:
            for event in events:
                if isinstance(event, RegionStreamed):
                    self.conductor.streamed(event.item, event.channel, event.index, event.value)
                elif isinstance(event, RegionOutput):
                    self.conductor.partial(event.item, event.outputs)
                elif isinstance(event, RegionConsumed):
                    self.conductor.consumed(
                        event.item, event.stream, event.base, event.received, event.closed
                    )
                elif isinstance(event, RegionDone):
                    self._region_over(event.item)
                    self.conductor.complete(event.item, event.outputs)
                else:
                    self._region_over(event.item)
                    self.conductor.fail(event.item, event.error)

        self._passes.post(apply)

    def _inputs(self, item: WorkItem) -> dict[str, Any]:
        """The item's inputs by value name: the component op's argument values (from the
        conductor's materialized call) and the values its glue reads."""
        values = dict(item.env)
        if item.call is not None:
            op = self._ops[item.walk][item.ops[0]]
            args, kwargs = item.call
            for arg, value in zip(op.args, args):
                if isinstance(arg, ir.Ref):
                    values[arg.name] = value
            for key, arg in op.kwargs.items():
                if isinstance(arg, ir.Ref):
                    values[arg.name] = kwargs[key]
        return values

    def _finished(self, future: Future[BatchResult], group: list[WorkItem]) -> None:
        error = future.exception()
        if error is not None:
            for item in group:
                self.conductor.fail(item.id, str(error))
        else:
            result = future.result()
            for item in group:
                if item.id in result.deferred:
                    self.conductor.defer(item.id)
                elif item.id in result.errors:
                    self.conductor.fail(item.id, result.errors[item.id])
                else:
                    self.conductor.complete(item.id, result.outputs[item.id])

    def _route(self, events: list[Event]) -> None:
        ended: list[str] = []
        streamed: dict[str, RequestHandle] = {}  # handles given items or ends: woken once
        over: list[tuple[RequestHandle, Event]] = []  # the ends, given once the rest is done
        for event in events:
            end = isinstance(event, (Finished, Failed))
            handle = self._handles.get(event.request)
            if handle is not None:
                if isinstance(event, StreamItem):
                    handle._event(event, notify=False)
                    streamed[event.request] = handle
                elif end:
                    over.append((handle, event))
                    del self._handles[event.request]
                else:
                    handle._event(event)  # an output: kept, no one woken
            if end:
                ended.append(event.request)
        # one message per rank for what ended in this pass, sent before any caller wakes: a
        # caller woken first takes the GIL while the send's syscall leaves it, and the rest
        # of this pass (the other callers' ends among it) waits for that caller to let go
        # (profiled over rounds of 16 concurrent rollouts: ~1.2 ms a round in this send, ~20
        # us alone; the rounds' time moved 0.5-3%, the caller working meanwhile)
        self.pool.release_requests(ended)
        for handle, event in over:
            handle._event(event, notify=False)
            streamed[handle.request_id] = handle
        wake_waiters(streamed.values())  # one call into each event loop for all of them
