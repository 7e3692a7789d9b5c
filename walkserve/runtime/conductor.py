"""The conductor: per-request walk state machines and readiness tracking, and nothing else.

It owns, for every live request, where the request is in its walk chain and which values of
which loop iteration exist, and derives from that which plan nodes may run (the review's
Algorithm 1; streaming readiness is its Algorithm 3). It never runs a node: its caller
(``local.run_local`` in tests, the worker scheduler when serving) runs the ``WorkItem``\\s that
``ready()`` returns and reports back with ``complete`` or ``fail``. It is pure: no sockets,
threads, processes or CUDA. Values are opaque to it, except that it slices tensors for
per-step ``select``\\s and stream chunks, and reads stop flags (``bool(t.item())``). The oracle
for what every request must compute is ``capture.interpret.Interpreter``, one request at a time.

This module holds the interface and the requests: submitting, results and failures of items,
cancelling, events, stats, entering and finishing walks, and advancing a request's state
machine. ``Conductor`` inherits the rest: its frames and their node items from
``FrameDriver`` (``runtime.framedriver``), its region items from ``RegionItems``
(``runtime.regionitems``), its maps' items from ``MapItems`` (``runtime.loopmaps``) and its
loops from ``LoopDriver`` (``runtime.loopdriver``); the state they share lives in
``runtime.frames``.

Data flow (every arrow is one method call on a ``Conductor``)::

    submit(id, inputs)  -> RequestState: state (inputs + outputs of finished walks), walk,
                           root Frame: the walk body's values, its undispatched ops
    complete(item, {op: value}) -> values bound in the item's frame -> _advance(request):
        ops whose inputs now exist in that frame     -> WorkItem queued for ready()
        loops whose inputs exist                      -> LoopRun (frames {i: Frame})
        iteration i+1 whose carried values exist      -> a new frame (speculative while
                                                         stop(i) is unknown)
        stop values, in iteration order               -> confirm i+1, or discard it
        complete iterations, in order                 -> commit: accumulate, feed streams,
                                                         StreamItem events (walk outputs that
                                                         exist already go first, once)
        loop done (bound, stop, end of stream)        -> channels bound in the parent frame
        walk body done                                -> Output events, next_walk: the next
                                                         walk, or Finished and release
    ready()   <- the queued WorkItems (each once)
    events()  <- Output, StreamItem, Finished, Failed (drained)

Frames and iterations of a DynamicLoop with speculation (``frame`` paths, outer to inner)::

    iteration   0          1            2
    frame       (0,)       (1,)         (2,)  started when (1,)'s carried values exist
    state       committed  running      speculative: stop(1) not yet known
                           stop(1) true -> (2,) discarded, its results ignored: one wasted step

Dispatch units: a plan node is one dispatch, split where the plan's grouping would delay work
(of a node's undispatched ops, those whose inputs exist go out first; see
``runtime.framedriver``).

Streams: a producer loop's accumulated channel feeds a ``Stream`` buffer as its iterations
commit; consumer iteration ``i`` starts once ``policy.ready(n, producer_finished) > i``, so the
consumer runs while the producer still produces. Items before ``policy.retain_from(next)`` are
released; a producer waits while its buffer holds ``stream_buffer_limit`` items, counting its
iterations in flight as one item each (backpressure).

Release: a value is dropped from its frame once every op and loop that reads it has been
dispatched or has finished (block outputs and stops stay until the frame ends); an iteration's
frame is dropped when it commits; everything of a request when it finishes, fails or is
cancelled. Results of items of released frames are ignored.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from walkserve.capture import dataflow, ir
from walkserve.capture.inputs import check_inputs
from walkserve.capture.interpret import MAX_TRANSITIONS, Interpreter
from walkserve.capture.loopsem import (
    LoopError,
)
from walkserve.capture.model import CapturedModel
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.framedriver import FrameDriver
from walkserve.runtime.frames import (
    Frame,
    Pending,
    RequestFailed,
    RequestState,
    count_values,
    frame_streams,
    piece_items,
)
from walkserve.runtime.walkspec import (
    MAP_AHEAD,
    BlockSpec,
    SpecBuilder,
    min_buffer,
)
from walkserve.runtime.workitem import (
    ConductorStats,
    Credit,
    Event,
    Failed,
    Feed,
    Finished,
    LoopStart,
    Output,
    StreamItem,
    WorkItem,
)

__all__ = [
    "Conductor",
    "ConductorStats",
    "Credit",
    "Event",
    "Failed",
    "Feed",
    "Finished",
    "LoopStart",
    "Output",
    "StreamItem",
    "WorkItem",
    "piece_items",
]

# ------------------------------------------------------------------------------ conductor


class Conductor(FrameDriver):
    """Per-request walk state machines over ``plan``; see the module docstring.

    ``speculate=False`` never starts an iteration of a DynamicLoop before the previous stop is
    known (zero wasted steps). ``stream_buffer_limit``: items a stream buffer may hold before
    its producer waits; it must cover the largest chunk (with context) of every stream.
    ``eager_outputs``: every walk output is an ``Output`` event as soon as its value exists
    (a region walk's, so that what its rank made reaches the conductor before the exit).
    ``fed``: per walk, streams whose items come from outside (``feed``), not from a value or
    a loop of the walk (a region walk's streams from another region). ``fast_loops``: a simple
    loop (a straight body of nodes, no stream in or out) is one ``kind="loop"`` item its
    runner steps by itself (``loopstep``), not a frame per iteration (a rank's conductor).
    ``maps``: the (walk, node) whose calls the runner batches as it likes (a rank's joinable
    nodes): a map over a stream or per-step values whose body is one such node
    (``LoopSpec.map_node``) sends the iterations that can start as one item with a call each
    (``WorkItem.calls``; ``map_calls`` at most, a rank's ``max_batch``), completed with each
    one's values, not a frame per iteration.
    """

    def __init__(
        self,
        captured: CapturedModel,
        plan: ExecutablePlan,
        *,
        speculate: bool = True,
        stream_buffer_limit: int = 64,
        eager_outputs: bool = False,
        fed: Mapping[str, Collection[str]] | None = None,
        fast_loops: bool = False,
        maps: Collection[tuple[str, str]] = (),
        map_calls: int | None = None,
    ) -> None:
        if stream_buffer_limit < 1:
            raise ValueError(f"stream_buffer_limit must be >= 1, got {stream_buffer_limit}")
        self.captured = captured
        self.speculate = speculate
        self.stream_buffer_limit = stream_buffer_limit
        self.eager_outputs = eager_outputs
        self._maps = frozenset(maps)
        self._map_calls = map_calls or MAP_AHEAD
        self._walks: dict[str, BlockSpec] = {}
        # per walk, the outputs sent as soon as they exist, with the values each reads
        self._early: dict[str, list[tuple[str, Any, tuple[str, ...]]]] = {}
        for name, walk in captured.graph.walks.items():
            self._early[name] = [
                (k, a, tuple(dataflow.arg_refs(a)))
                for k, a in walk.outputs.items()
                if k not in walk.state
            ]
            if name not in plan.walks:
                raise ValueError(f"the plan has no walk {name!r}; was it lowered from this model?")
            pinned = {r for a in walk.outputs.values() for r in dataflow.arg_refs(a)}
            builder = SpecBuilder(captured, walk, plan, fast_loops)
            spec = builder.block(walk.body, plan.walks[name], pinned, True)
            self._walks[name] = spec
            self._check_streams(name, spec)
        self._interp = Interpreter(captured)
        self._requests: dict[str, RequestState] = {}
        self._items: dict[int, Pending] = {}
        self._queue: list[WorkItem] = []
        self.deferred_items = 0
        self._events: list[Event] = []
        self._ids = itertools.count()
        self._next_id = 0
        self._speculated = 0
        self._wasted = 0
        self._dropped: list[int] = []  # region items released while their rank ran them
        self._feeds: list[Feed] = []
        self._credits: list[Credit] = []
        self._credit: dict[str, dict[str, int]] = {}  # region walks: request -> channel -> items
        self._produced: dict[str, dict[str, int]] = {}
        self._fed = {w: frozenset(streams) for w, streams in (fed or {}).items()}

    def _check_streams(self, walk: str, spec: BlockSpec) -> None:
        for s in spec.streams.values():
            need = min_buffer(s.policy)
            if s.backpressure and self.stream_buffer_limit < need:
                raise ValueError(
                    f"stream_buffer_limit={self.stream_buffer_limit} cannot hold one chunk of "
                    f"stream {s.edge.name!r} of walk {walk!r} ({s.policy.to_json()}); "
                    f"use at least {need}"
                )
        for ls in spec.loops:
            self._check_streams(walk, ls.body)

    # ------------------------------------------------------------------ the interface

    def submit(
        self,
        request_id: str,
        inputs: Mapping[str, Any],
        walk: str | None = None,
        stream: bool | Collection[str] = True,
    ) -> None:
        """Start a request at ``walk`` (default: the model's first entry walk). ``stream``:
        the client reads ``StreamItem`` events (of every streamed output, or of those named);
        without it only the final outputs are made (and no rank reports a client stream's
        items one by one)."""
        graph = self.captured.graph
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already live")
        if walk is None:
            entries = graph.entry_walks()
            if not entries:
                raise ValueError("the model has no entry walk (every walk is another's next)")
            walk = entries[0]
        if walk not in graph.walks:
            raise ValueError(f"unknown walk {walk!r}; the model has {sorted(graph.walks)}")
        self._check_inputs(walk, inputs)
        req = RequestState(request_id, walk, dict(inputs), Frame(self._walks[walk], (), None), {})
        req.stream = stream if isinstance(stream, bool) else frozenset(stream)
        self._requests[request_id] = req
        self._enter_walk(req, walk)
        self._advance(req)

    def ready(self) -> list[WorkItem]:
        """Items whose inputs exist (same request, same iteration), each returned once."""
        items = [it for it in self._queue if it.id in self._items]
        self._queue = []
        return items

    def complete(self, item_id: int, value: Any) -> None:
        """``value``: ``{op: result}`` for every op of the item. Results of items of released
        requests or discarded iterations are ignored."""
        req = self._bind_item(item_id, value)
        if req is not None:
            self._advance(req)

    def complete_all(self, results: Sequence[tuple[int, Any]]) -> None:
        """``complete`` of each ``(item, value)``, every result bound before each request's
        state machine advances, once: a step's results for several iterations of one request
        (a window decoder's windows) cost one advance, not one each. The state reached is the
        same (an advance runs to its fixed point)."""
        touched: dict[str, RequestState] = {}
        for item_id, value in results:
            req = self._bind_item(item_id, value)
            if req is not None:
                touched[req.id] = req
        for req in touched.values():
            self._advance(req)

    def _bind_item(self, item_id: int, value: Any) -> RequestState | None:
        """An item's results bound in its frame; its request, to advance (None: ignored or
        failed)."""
        p = self._take(item_id)
        if p is None:
            return None
        if p.window is not None:
            return self._bind_map(p, value)
        need = [op for op in p.item.outputs if op not in p.delivered]
        missing = [op for op in need if op not in value] if isinstance(value, Mapping) else need
        if missing:
            self._node_failed(p, f"result has no value for ops {list(missing)}")
            return None
        self._bind_results(p, value)
        if p.region is not None:
            for stream, _ in p.region.feeds:  # a fast producer loop is done
                p.frame.streams[stream].finished = True
            for streams in p.region.forwards.values():
                for stream in streams:
                    fwd = p.frame.forwards[stream]
                    fwd.finished = True
                    self._flush(p.request, fwd)
        return p.request

    def _bind_results(self, p: Pending, value: Mapping[str, Any]) -> None:
        frame = p.frame
        for op in p.ops:
            if op in p.delivered or (p.region is not None and op not in value):
                continue
            p.delivered.add(op)
            left = frame.uses.get(op, 0) - p.internal.get(op, 0)
            frame.uses[op] = left
            if left > 0 or op in frame.spec.pinned:
                frame.env[op] = value[op]

    def wanted(self, item_id: int) -> bool:
        """Whether a dispatched item's result is still awaited (not cancelled, failed or
        dropped with a mispredicted speculative step)."""
        return item_id in self._items

    def defer(self, item_id: int) -> None:
        """The runner could not run the item now (its component had no memory for it): it is
        ready again, unchanged, in the next ``ready()``. Released items: no-op."""
        p = self._items.get(item_id)
        if p is not None:
            self._queue.append(p.item)
            self.deferred_items += 1

    def fail(self, item_id: int, error: str) -> None:
        """The item's node raised: its request fails (after the fact, if the item belongs to
        a speculative iteration that turns out to run); other requests are untouched."""
        p = self._take(item_id)
        if p is not None:
            self._node_failed(p, error)

    def cancel(self, request_id: str) -> None:
        """Drop every value, frame and buffer of the request; no event. Unknown ids: no-op."""
        req = self._requests.get(request_id)
        if req is not None:
            self._release(req)

    def events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def idle(self) -> bool:
        return not self._requests

    def stats(self) -> ConductorStats:
        by_request = {rid: count_values(req) for rid, req in self._requests.items()}
        return ConductorStats(
            speculated_steps=self._speculated,
            wasted_steps=self._wasted,
            live_requests=len(self._requests),
            in_flight=len(self._items),
            buffered_stream_items=sum(
                s.buffered for req in self._requests.values() for s in frame_streams(req.root)
            ),
            live_values=sum(by_request.values()),
            live_values_by_request=by_request,
            deferred_items=self.deferred_items,
        )

    # ------------------------------------------------------------------ requests and walks

    def _check_inputs(self, walk: str, inputs: Mapping[str, Any]) -> None:
        """The walk's inputs, and along a static ``next`` chain every later walk's inputs
        that no earlier walk outputs, must be given, and be valid (``check_inputs``)."""
        graph = self.captured.graph
        have = set(inputs)
        seen: set[str] = set()
        produced: set[str] = set()
        current: str | None = walk
        while current is not None and current not in seen:
            w = graph.walks[current]
            missing = [i.name for i in w.inputs if i.name not in have and i.default is None]
            if missing:
                raise ValueError(f"walk {current!r} needs inputs {missing}")
            check_inputs(w, {k: v for k, v in inputs.items() if k not in produced})
            have |= set(w.outputs)
            produced |= set(w.outputs)
            seen.add(current)
            current = None if graph.custom_transition else w.next
        if graph.custom_transition:  # next_walk() may pick any walk: each checks what it takes
            for w in graph.walks.values():
                check_inputs(w, {k: v for k, v in inputs.items() if k not in produced})

    def _enter_walk(self, req: RequestState, walk: str) -> None:
        w = self.captured.graph.walks[walk]
        given = ir.with_defaults(w, req.state)
        missing = [i.name for i in w.inputs if i.name not in given]
        if missing:
            raise RequestFailed(f"walk {walk!r} needs inputs {missing}")
        req.walk = walk
        req.walk_inputs = {i.name: given[i.name] for i in w.inputs}
        req.sent = set()
        req.root = self._new_frame(self._walks[walk], (), None, req.walk_inputs)

    def _finish_walk(self, req: RequestState) -> None:
        w = self.captured.graph.walks[req.walk]
        outputs = {k: self._interp.value(a, req.root.env) for k, a in w.outputs.items()}
        for k, v in outputs.items():
            if k not in w.state and k not in req.sent:
                self._events.append(Output(req.id, w.name, k, v))
        req.state.update(outputs)
        nxt = self.captured.next_walk(req.state, w.name, outputs)
        if nxt is None:
            self._events.append(Finished(req.id))
            self._release(req)
            return
        req.transitions += 1
        if req.transitions >= MAX_TRANSITIONS:
            raise RequestFailed(f"more than {MAX_TRANSITIONS} walk transitions")
        self._kill(req.root)
        self._enter_walk(req, nxt)

    def _send_ready_outputs(self, req: RequestState) -> None:
        """Walk outputs whose values exist already (a prefill's first token, while the decode
        loop streams the next ones) as ``Output`` events, each once per walk, so that a client
        reading a stream has them before the stream's items."""
        early = self._early[req.walk]
        if len(req.sent) == len(early):  # each sent once per walk: nothing left
            return
        env = req.root.env
        for k, a, refs in early:
            if k in req.sent or not all(r in env for r in refs):
                continue
            req.sent.add(k)
            name = self.captured.graph.walks[req.walk].name
            self._events.append(Output(req.id, name, k, self._interp.value(a, env)))

    def _advance(self, req: RequestState) -> None:
        """Run the request's state machine until nothing changes; any error fails it."""
        try:
            while req.id in self._requests:
                while self._pump(req, req.root):
                    pass
                if self.eager_outputs:
                    self._send_ready_outputs(req)
                if not req.root.done():
                    break
                self._finish_walk(req)
        except (RequestFailed, LoopError) as e:
            self._fail_request(req, str(e))
        except Exception as e:  # a bad request never takes the conductor down
            self._fail_request(req, f"{type(e).__name__}: {e}")

    def _fail_request(self, req: RequestState, error: str) -> None:
        if self._requests.get(req.id) is req:
            self._events.append(Failed(req.id, error))
            self._release(req)

    def _release(self, req: RequestState) -> None:
        self._credit.pop(req.id, None)
        self._produced.pop(req.id, None)
        self._kill(req.root)
        req.state.clear()
        req.walk_inputs.clear()
        del self._requests[req.id]

    def _take(self, item_id: int) -> Pending | None:
        p = self._items.pop(item_id, None)
        if p is None:
            if not 0 <= item_id < self._next_id:
                raise KeyError(f"no work item {item_id} was ever issued")
            return None  # released, discarded, or reported before
        p.frame.inflight.discard(item_id)
        return p

    def _node_failed(self, p: Pending, error: str) -> None:
        walk = p.request.walk.partition("@")[0]  # a region walk names its walk first
        message = (
            error if p.region is not None else f"node {p.node} of walk {walk!r} failed: {error}"
        )
        if p.frame.in_speculation():
            p.frame.error = p.frame.error or message  # decided when the iteration is
        else:
            self._fail_request(p.request, message)
