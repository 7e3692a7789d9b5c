"""``serve(...)``: the runtime's Python API. The conductor in this process, one worker
process per rank, requests in, outputs and streamed items out.

    server = serve("example-speech", placement)          # or serve(capture_model(name), ...)
    server.run({"prompt_ids": ids, "max_new_tokens": 8})  # blocking: the client outputs
    handle = server.submit(inputs)                         # RequestHandle
    for item in handle.stream(): ...                       # StreamItem as iterations commit
    handle.result(); handle.cancel()
    server.health(); server.stats(); server.close()        # also a context manager
    server.drain(grace_s=30)                               # stop admitting, let requests end

A conductor pass (one at a time; no thread of its own: the thread that posts a task (a
submit, a cancel) makes one pass itself, a burst of submissions at its caller's first wait, and
the pool's io thread makes one after every batch of replies it reads, so a reply reaches the
conductor with no hand-off: ``runtime/passes.py``)::

    items   = conductor.ready()                  schedule: ready work of every request
    batches = group(items)                       by (walk, plan node, ops, rank)
    futures = pool.submit_batch(...)             run: one RunBatch per group, on its rank
    conductor.complete / fail(...)               postprocess, as each batch's reply arrives
    route(conductor.events())                    outputs and stream items to their handles

Planning overlaps execution: while batches are out on the workers, each pass keeps taking
newly ready items (the next iteration of another request, another branch) and dispatching
them. A worker that dies (or hangs past its deadline and is killed) fails the requests whose
batches it held, with an error naming the rank; requests that need only other ranks go on.
The pool restarts it (``supervisor``); work sent to it meanwhile waits for it. No request is
retried: a failed one is the client's to send again. ``unavailable()`` says why new work
would not be served now (a rank restarting or failed, draining, the conductor stopped): the HTTP
layer answers 503 with Retry-After then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from walkserve.capture import ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.batched import merges_calls
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.batcher import Batch, Batcher
from walkserve.runtime.conductor import (
    Conductor,
    ConductorStats,
    Event,
    Failed,
    Finished,
    WorkItem,
)
from walkserve.runtime.handle import RequestFailed as RequestFailed  # re-exported
from walkserve.runtime.handle import RequestHandle
from walkserve.runtime.limits import WalkLimits, check_limits
from walkserve.runtime.messages import (
    KVStats,
    RankStatsReply,
    RegionConsumed,
    RegionDone,
    RegionOutput,
    RegionStreamed,
)
from walkserve.runtime.passes import Admission, Passes
from walkserve.runtime.pool import BatchResult, RankHealth, WorkerPool

log = logging.getLogger("walkserve.server")

MAX_FAULTS = 3  # unexpected conductor failures within FAULT_WINDOW_S that stop the server
FAULT_WINDOW_S = 10.0


@dataclass(frozen=True)
class RuntimeStats(ConductorStats):
    """``ConductorStats`` of the whole runtime: the counters add the ranks' (speculation
    inside region runs, values their runs and object stores hold); ``conductor`` and
    ``ranks`` are the parts."""

    conductor: ConductorStats | None = None
    ranks: Mapping[int, RankStatsReply] = field(default_factory=dict)

    @property
    def counters(self) -> dict[str, int]:
        """The components' counters (``"module path/counter"``), summed over the ranks."""
        total: dict[str, int] = {}
        for reply in self.ranks.values():
            for key, value in reply.counters.items():
                total[key] = total.get(key, 0) + value
        return total


class Server:
    """See the module docstring. Built by ``serve``."""

    def __init__(
        self,
        captured: CapturedModel,
        plan: ExecutablePlan,
        pool: WorkerPool,
        *,
        speculate: bool = True,
        stream_buffer_limit: int = 64,
        max_inflight: int = 1,
        limits: WalkLimits | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.captured = captured
        self.plan = plan
        self.pool = pool
        self.limits = limits or WalkLimits()
        self.conductor = Conductor(
            captured, plan, speculate=speculate, stream_buffer_limit=stream_buffer_limit
        )
        nodes = {(w, n.name): n for w in plan.walks for n in plan.nodes(w)}
        self._ops: dict[str, dict[str, ir.Op]] = {
            w.name: {n.name: n for n in ir.iter_nodes(w.body) if isinstance(n, ir.Op)}
            for w in captured.graph.walks.values()
        }
        # what the conductor is to do, run in order by whichever thread makes the next pass
        self._passes = Passes(self._pass, pool)
        self._faults: list[float] = []  # when passes failed unexpectedly, within FAULT_WINDOW_S
        self._admitted: list[Callable[[], None]] = []  # callers to wake after this dispatch
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
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
        self.max_inflight = max_inflight
        self._region_rank: dict[int, int] = {}  # region items out -> their rank
        pool.regions.on_regions = self._region_events
        pool.on_io_pass = self._passes.pump
        self._closed = False
        self.fatal: str | None = None  # why the conductor stopped, if it did
        self.draining: str | None = None  # why new requests are refused (``drain``)
        self.cross_host_edges: list[Any] = []  # runtime.net.link.CrossHostEdge
        self.closers: list[Callable[[], None]] = []  # run after the pool closed (a launcher)

    # ---------------------------------------------------------------- client API

    def submit(
        self,
        inputs: Mapping[str, Any],
        walk: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> RequestHandle:
        return self.submit_future(inputs, walk, request_id, stream).result()  # bad: raises

    async def submit_async(
        self,
        inputs: Mapping[str, Any],
        walk: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> RequestHandle:
        """``submit`` for asyncio code: waits for admission without holding a thread."""
        admitted = self._submit(inputs, walk, request_id, stream, burst=False)[1]
        return await asyncio.wrap_future(admitted)

    def submit_future(
        self,
        inputs: Mapping[str, Any],
        walk: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> Future[RequestHandle]:
        """Queue ``inputs`` for admission by the next conductor pass; the future holds the handle,
        or the error that says why the request was refused. ``stream=False``: the handle
        gets the final outputs only (``stream()`` yields nothing), and nothing is reported
        item by item for it: what ``run()`` and non-streamed answers need."""
        return self._submit(inputs, walk, request_id, stream)[1]

    def _submit(
        self,
        inputs: Mapping[str, Any],
        walk: str | None,
        request_id: str | None,
        stream: bool,
        burst: bool = True,
    ) -> tuple[RequestHandle, Future[RequestHandle]]:
        """``submit_future``, and the handle the future will hold (finished as failed when
        the request is refused, so that a wait on it ends either way). ``burst``: it may wait
        for the pass of a burst it is part of (``passes``), which its caller's first wait (on
        the future or the handle) makes."""
        if self._closed:
            raise RuntimeError("the server is closed")
        if self.fatal is not None:
            raise RuntimeError(f"the server stopped: {self.fatal}")
        if self.draining is not None:
            raise RuntimeError(self.draining)
        graph = self.captured.graph
        start = walk if walk is not None else next(iter(graph.entry_walks()), None)
        if start in graph.walks:  # else the conductor says what is wrong
            check_limits(graph, start, inputs, self.limits)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(rid, self)
        done: Future[RequestHandle] = Admission(self._passes)

        def admit() -> None:
            try:
                self.conductor.submit(rid, inputs, walk, stream=stream)
                self._handles[rid] = handle
            except Exception as e:
                done.set_exception(e)
                handle._finish(str(e))
                return
            # the caller is woken once this pass has dispatched the request's first work:
            # its thread must not take the GIL from the dispatch that its request waits for
            self._admitted.append(lambda: done.set_result(handle))

        self._passes.post(admit, submission=burst)
        return handle, done

    def run(
        self, inputs: Mapping[str, Any], walk: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """The outputs of one request, or the error that refused or failed it; ``timeout``
        covers its admission too. The caller waits once, for the end (not also for the
        admission, a second wake of its thread per request)."""
        handle, admitted = self._submit(inputs, walk, None, False)
        self.admit_waiting()
        if not handle._done.wait(timeout):
            raise TimeoutError(f"request {handle.request_id} did not finish in {timeout} s")
        refused = admitted.exception() if admitted.done() else None
        if refused is not None:
            raise refused
        return handle.result(0)

    def cancel(self, request_id: str) -> None:
        def drop() -> None:
            self.conductor.cancel(request_id)
            self.pool.release_request(request_id)
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                handle._finish("cancelled")

        self._passes.post(drop)

    def health(self) -> dict[int, RankHealth]:
        return self.pool.health()

    def unavailable(self) -> str | None:
        """Why a new request would not be served now (None: it would): the server drains or
        stopped, or a rank restarts (its work waits) or failed for good. A rank ``dead`` with
        restarts off is not a reason: requests that need it fail, naming it; others go on."""
        if self.fatal is not None:
            return f"the server stopped: {self.fatal}"
        if self.draining is not None:
            return self.draining
        for rank, h in sorted(self.pool.health().items()):
            if h.status == "failed":
                return f"worker rank {rank} failed: {h.error}"
            if h.status in ("restarting", "starting"):
                return f"worker rank {rank} is restarting (restart {h.restarts})"
        return None

    def drain(self, grace_s: float, poll_s: float = 0.05) -> bool:
        """Refuse new requests from now on and wait up to ``grace_s`` for the admitted ones
        to finish; True if they all did. ``close()`` then fails whatever is left."""
        self.draining = self.draining or "the server is shutting down"
        deadline = time.monotonic() + grace_s
        while self._handles or self._passes.tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def kv_stats(self) -> dict[int, list[KVStats]]:
        """Paged KV pools per rank, as of each worker's last heartbeat."""
        return self.pool.kv_stats()

    def stats(self, timeout: float = 30.0) -> RuntimeStats:
        """The conductor's counters and state, with every rank's added in (``ranks``: each
        rank's own). Live values count what the conductor holds and what the ranks' region
        runs and object stores hold."""
        result: Future[ConductorStats] = Future()
        self._passes.post(lambda: result.set_result(self.conductor.stats()))
        outer = result.result(timeout)
        ranks = self.pool.regions.stats(timeout)
        return RuntimeStats(
            speculated_steps=outer.speculated_steps
            + sum(r.speculated_steps for r in ranks.values()),
            wasted_steps=outer.wasted_steps + sum(r.wasted_steps for r in ranks.values()),
            live_requests=outer.live_requests,
            in_flight=outer.in_flight,
            buffered_stream_items=outer.buffered_stream_items,
            live_values=outer.live_values + sum(r.live_values + r.objects for r in ranks.values()),
            live_values_by_request=outer.live_values_by_request,
            deferred_items=outer.deferred_items,
            conductor=outer,
            ranks=ranks,
        )

    @property
    def batch_sizes(self) -> dict[int, int]:
        """Items per batch -> batches: the conductor's node batches and every rank's steps."""
        sizes = dict(self.batcher.sizes)
        for reply in self.pool.regions.stats().values():
            for k, v in reply.batch_sizes.items():
                sizes[k] = sizes.get(k, 0) + v
        return sizes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._passes.lock:  # a pass under way ends first; none runs after it
            self._passes.stopped = True
        self.pool.close()
        for closer in self.closers:
            closer()
        for handle in self._handles.values():
            handle._finish("the server closed")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the passes

    def admit_waiting(self) -> None:
        """Admit the submissions still queued (a burst's: ``passes``), if a pass is due."""
        self._passes.admit_waiting()

    def _pass(self) -> None:
        """One pass: run the queued tasks, dispatch what is ready, route the events. It never
        fails silently: an unexpected exception is logged with its traceback and fails every
        request the conductor holds (their state may be half updated); ``MAX_FAULTS`` of them
        within ``FAULT_WINDOW_S`` stop the server, ``fatal`` saying why (``/health`` answers
        503, ``walkserve serve`` exits)."""
        try:
            self._passes.run_tasks()
            self._dispatch(self.conductor.ready())
            self._wake_admitted()
            self._route(self.conductor.events())
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

    def _dispatch(self, items: list[WorkItem]) -> None:
        """Send ready ``items`` as the batcher groups them (one ``RunBatch`` per node batch,
        one ``StartRegions`` per rank), and tell ranks about region runs no one waits for."""
        for batch in self.batcher.batches(items, self.conductor.wanted):
            if batch.kind == "regions":
                for it in batch.items:
                    self._region_rank[it.id] = batch.rank
                starts = [
                    (it.id, it.request, it.walk, it.node, it.env, it.stream) for it in batch.items
                ]
                try:
                    self.pool.regions.start(batch.rank, starts)
                except Exception:  # an input with no wire form: find it, fail its request
                    for start in starts:
                        try:
                            self.pool.regions.start(batch.rank, [start])
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
        for event in events:
            over = isinstance(event, (Finished, Failed))
            handle = self._handles.get(event.request)
            if handle is not None:  # the caller first: the ranks' cleanup is not its wait
                handle._event(event)
                if over:
                    del self._handles[event.request]
            if over:
                ended.append(event.request)
        self.pool.release_requests(ended)  # one message per rank for what ended in this pass


# serve() starts a Server (runtime/startup.py); imported here, below Server, for the callers
# that import it from this module.
from walkserve.runtime.startup import serve as serve  # noqa: E402
