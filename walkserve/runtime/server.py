"""``serve(...)``: the runtime's Python API. The conductor in this process, one worker
process per rank, requests in, outputs and streamed items out.

    server = serve("example-speech", placement)          # or serve(capture_model(name), ...)
    server.run({"prompt_ids": ids, "max_new_tokens": 8})  # blocking: the client outputs
    handle = server.submit(inputs)                         # RequestHandle
    for item in handle.stream(): ...                       # StreamItem as iterations commit
    handle.result(); handle.cancel()
    server.health(); server.stats(); server.close()        # also a context manager
    server.drain(grace_s=30)                               # stop admitting, let requests end

The conductor runs in passes (``conductorpass``: ready work out to the ranks, replies in,
events out to the handles; ``Server`` is a ``ConductorPass``), one at a time and on no thread
of its own: the thread that posts a task (a cancel, an HTTP submission) makes one pass itself,
a submission of this API at its caller's first wait (with all submitted by then: a burst in
one pass), and the pool's io thread makes one after every batch of replies it reads, so a
reply reaches the conductor with no hand-off (``passes``).

A worker that dies (or hangs past its deadline and is killed) fails the requests whose
batches it held, with an error naming the rank; requests that need only other ranks go on.
The pool restarts it (``supervisor``); work sent to it meanwhile waits for it. No request is
retried: a failed one is the client's to send again. ``unavailable()`` says why new work
would not be served now (a rank restarting or failed, draining, the conductor stopped): the HTTP
layer answers 503 with Retry-After then.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from walkserve.capture.model import CapturedModel
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.conductor import Conductor, ConductorStats
from walkserve.runtime.conductorpass import ConductorPass
from walkserve.runtime.handle import RequestFailed as RequestFailed  # re-exported
from walkserve.runtime.handle import RequestHandle
from walkserve.runtime.limits import WalkLimits, check_limits
from walkserve.runtime.messages import KVStats, RankStatsReply
from walkserve.runtime.passes import Admission
from walkserve.runtime.pool import RankHealth, WorkerPool


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


class Server(ConductorPass):
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
        self._ids = itertools.count()
        self.max_inflight = max_inflight
        self._closed = False
        self.draining: str | None = None  # why new requests are refused (``drain``)
        self.cross_host_edges: list[Any] = []  # runtime.net.link.CrossHostEdge
        self.closers: list[Callable[[], None]] = []  # run after the pool closed (a launcher)
        # the conductor passes (``conductorpass``): the pool's io thread may make one from now
        self._open_passes(max_inflight)

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
        admitted = self._submit(inputs, walk, request_id, stream, at_wait=False)[1]
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
        at_wait: bool = True,
    ) -> tuple[RequestHandle, Future[RequestHandle]]:
        """``submit_future``, and the handle the future will hold (finished as failed when
        the request is refused, so that a wait on it ends either way). ``at_wait``: admitted
        by the pass its caller's first wait (on the future or the handle) makes, with all
        submitted by then (``passes``); else by a pass now."""
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

        self.pool.wake()  # a rank that slept wakes while this request is admitted
        self._passes.post(admit, submission=at_wait)
        return handle, done

    def run(
        self, inputs: Mapping[str, Any], walk: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """The outputs of one request, or the error that refused or failed it; ``timeout``
        covers its admission too. The caller waits once, for the end (not also for the
        admission, a second wake of its thread per request). It waits at once: its pass is
        made now (no deadline for the io thread to wake for)."""
        handle, admitted = self._submit(inputs, walk, None, False, at_wait=False)
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

    def admit_waiting(self) -> None:
        """Admit the submissions still queued for their callers' wait (``passes``), if any."""
        self._passes.admit_waiting()


# serve() starts a Server (runtime/startup.py); imported here, below Server, for the callers
# that import it from this module.
from walkserve.runtime.startup import serve as serve  # noqa: E402
