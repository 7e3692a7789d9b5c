"""The conductor: per-request walk state machines and readiness tracking, and nothing else.

It owns, for every live request, where the request is in its walk chain and which values of
which loop iteration exist, and derives from that which plan nodes may run (the review's
Algorithm 1; streaming readiness is its Algorithm 3). It never runs a node: its caller
(``local.run_local`` in tests, the worker scheduler when serving) runs the ``WorkItem``\\s that
``ready()`` returns and reports back with ``complete`` or ``fail``. It is pure: no sockets,
threads, processes or CUDA. Values are opaque to it, except that it slices tensors for
per-step ``select``\\s and stream chunks, and reads stop flags (``bool(t.item())``). The oracle
for what every request must compute is ``capture.interpret.Interpreter``, one request at a time.

Data flow (every arrow is one method call on a ``Conductor``)::

    submit(id, inputs)  -> _Request: state (inputs + outputs of finished walks), walk,
                           root _Frame: the walk body's values, its undispatched ops
    complete(item, {op: value}) -> values bound in the item's frame -> _advance(request):
        ops whose inputs now exist in that frame     -> WorkItem queued for ready()
        loops whose inputs exist                      -> _LoopRun (frames {i: _Frame})
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

Dispatch units: a plan node is one dispatch, but the conductor splits it where the plan's
grouping would delay work: of a node's undispatched ops it dispatches those whose inputs exist
(or come from earlier ops of the same item), in order. A component node whose fused glue reads
a parallel branch's output thus dispatches the component at once and the glue later (as a
``glue`` item of the same node), and a glue group mixing early and late inputs runs in parts.

Streams: a producer loop's accumulated channel feeds a ``_Stream`` buffer as its iterations
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
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import torch

from walkserve.capture import ir
from walkserve.capture.chunk import (
    ChunkPolicy,
    ChunkSpan,
    FixedChunk,
    LeftContext,
    SlidingWindow,
    take,
)
from walkserve.capture.interpret import MAX_TRANSITIONS, Interpreter
from walkserve.capture.loopsem import (
    LoopError,
    int_input,
    loop_bound,
    loop_channels,
    step_value,
    truth,
)
from walkserve.capture.model import CapturedModel
from walkserve.lowering.plan import BlockPlan, ExecutablePlan, NodePlan, RegionPlan

NodeKind = Literal["component", "glue", "region", "loop"]
UNLIMITED = 1 << 62  # a credit that never holds a producer back

# ------------------------------------------------------------------------------ public types


@dataclass(frozen=True)
class LoopStart:
    """A loop item's start (``kind="loop"``): its runner runs the loop ``loop`` by itself for
    at most ``bound`` iterations and completes the item with ``channels``; the accumulated
    channels in ``streams`` it reports as each iteration commits (``streamed``). ``carried``,
    ``fixed``: the parameters' initial and invariant values; ``sources``: a per-step slice's
    source value, or a table's values (a list), by parameter."""

    loop: str
    bound: int
    carried: dict[str, Any]
    fixed: dict[str, Any]
    sources: dict[str, Any]
    channels: tuple[str, ...]
    streams: tuple[str, ...]


@dataclass(frozen=True)
class WorkItem:
    """Ops of one plan node for one request at one loop iteration, inputs materialized.

    ``ops`` are the IR op names to run, in order; for ``kind="component"`` the first is the
    component op, called with ``call`` = (args, kwargs), and the rest is glue fused into it.
    ``kind="region"``: ``node`` names a ``RegionPlan`` of the walk, which its rank runs by
    itself; ``env`` holds its inputs, ``outputs`` the values it reports at its exit
    (``complete``), and its streamed channels' items come before that (``streamed``).
    ``env`` holds every value the item's glue ops read from outside the item (by name; model
    attributes and constants are resolved by the runner). ``frame`` is the loop iteration path,
    outer to inner (``()`` outside loops). ``speculative``: dispatched before the stop of the
    previous iteration was known. ``outputs``: the ops whose values are read after the item
    (by later items, the client or the frame's end); the others are used inside the item only
    and need not come back. Report with ``complete(id, {op: value for op in outputs})`` (more
    values are ignored).
    """

    id: int
    request: str
    walk: str
    node: str
    kind: NodeKind
    ops: tuple[str, ...]
    frame: tuple[int, ...]
    speculative: bool
    call: tuple[list[Any], dict[str, Any]] | None = field(default=None, repr=False)
    env: Mapping[str, Any] = field(default_factory=dict, repr=False)
    outputs: tuple[str, ...] = ()
    loop: LoopStart | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Output:
    """A client output of walk ``walk``, at the walk's end."""

    request: str
    walk: str
    name: str
    value: Any


@dataclass(frozen=True)
class StreamItem:
    """Iteration ``index``'s contribution to client output ``channel`` (an accumulated
    channel of a walk-level loop), as soon as that iteration commits. The final ``Output`` of
    ``channel`` is these values joined as the loop's accumulation says (cat or stack)."""

    request: str
    channel: str
    index: int
    value: Any


@dataclass(frozen=True)
class Finished:
    request: str


@dataclass(frozen=True)
class Failed:
    request: str
    error: str


Event = Output | StreamItem | Finished | Failed


@dataclass(frozen=True)
class Feed:
    """Items of stream ``stream`` for region item ``item`` (its consumer), from another
    region: ``pieces`` in order; ``finished``: the producer is done (no piece follows)."""

    item: int
    request: str
    stream: str
    pieces: tuple[Any, ...]
    finished: bool


@dataclass(frozen=True)
class Credit:
    """Region item ``item`` may commit items of channel ``channel`` up to ``items`` (its
    consumers' buffers are that full then): backpressure from region to region."""

    item: int
    request: str
    channel: str
    items: int


@dataclass(frozen=True)
class ConductorStats:
    """Counters since construction (steps) and a snapshot of what is held now."""

    speculated_steps: int  # iterations started before the previous stop was known
    wasted_steps: int  # speculative iterations discarded after dispatching work
    live_requests: int
    in_flight: int  # items queued or returned by ready(), not yet completed
    buffered_stream_items: int
    live_values: int
    live_values_by_request: Mapping[str, int]
    deferred_items: int = 0  # items a runner sent back to be run later (``defer``)


# ------------------------------------------------------------------------------ static specs


@dataclass(frozen=True)
class _OpSpec:
    op: ir.Op
    reads: tuple[str, ...]  # names of the values it reads (each once)


@dataclass(frozen=True)
class _NodeSpec:
    name: str
    ops: tuple[_OpSpec, ...]


@dataclass(frozen=True)
class _RegionSpec:
    """A region its rank runs by itself (``RegionPlan``): a node with many outputs."""

    name: str
    reads: tuple[str, ...]  # values of the block it needs to start
    trip_inputs: tuple[str, ...]  # walk inputs its loops' bounds name
    outputs: tuple[str, ...]
    emit: dict[str, tuple[str, ...]]  # streamed channel -> client outputs (walk level)
    forwards: dict[str, tuple[str, ...]]  # channel -> the streams it feeds (other regions)
    fed: tuple[str, ...]  # streams it consumes from other regions


@dataclass(frozen=True)
class _StreamSpec:
    edge: ir.StreamEdge
    policy: ChunkPolicy
    producer: str | None  # the sibling loop whose accumulated channel is the source, if any
    acc: ir.Accumulated | None
    backpressure: bool  # False where the consumer cannot start before the producer ends


@dataclass(eq=False)
class _LoopSpec:
    node: ir.LoopNode
    body: _BlockSpec
    need: tuple[str, ...]  # outer values needed to start (init, invariant, select, table)
    step_reads: tuple[str, ...]  # outer values read per iteration, released at the end
    speculative: bool  # the loop and every component of its body allow speculation
    visible: ir.LoopNode  # the loop as its block reads it: unread accumulations left out
    feeds: tuple[tuple[str, str], ...]  # (stream, channel) pairs this loop produces into
    emit: dict[str, tuple[str, ...]]  # accumulated channel -> client outputs (walk level)
    fast: bool = False  # handed to the runner whole (``fast_loops``): a simple loop


@dataclass(eq=False)
class _BlockSpec:
    params: tuple[str, ...]
    nodes: tuple[_NodeSpec, ...]
    loops: tuple[_LoopSpec, ...]
    regions: tuple[_RegionSpec, ...]
    streams: dict[str, _StreamSpec]  # streams between loops of this block, by name
    uses: dict[str, int]  # readers of each value: ops, loop starts, loop ends
    pinned: frozenset[str]  # values kept until the frame ends (block outputs, stop)


def _unique(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _loop_reads(node: ir.LoopNode) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(needed to start, read per step) outer values of a loop; stream sources excluded."""
    need: list[str] = []
    step: list[str] = []
    for p in node.params:
        role = p.role
        if isinstance(role, ir.Carried):
            need += ir.arg_refs(role.init)
        elif isinstance(role, ir.Invariant):
            need += ir.arg_refs(role.value)
        elif isinstance(role.source, ir.SelectStep):
            step += ir.arg_refs(role.source.source)
        elif isinstance(role.source, ir.TableStep):
            step += [r for v in role.source.values for r in ir.arg_refs(v)]
    return _unique(need + step), _unique(step)


def _min_buffer(policy: ChunkPolicy) -> int:
    """Items a buffer must hold for the consumer's next chunk to become ready."""
    if isinstance(policy, FixedChunk):
        return policy.size
    if isinstance(policy, LeftContext):
        return policy.context + max(policy.chunk, policy.first_size)
    assert isinstance(policy, SlidingWindow)
    return policy.window


class _SpecBuilder:
    """Builds the ``_BlockSpec`` tree of one walk from its IR and its plan."""

    def __init__(
        self,
        captured: CapturedModel,
        walk: ir.Walk,
        plan: ExecutablePlan,
        fast_loops: bool = False,
    ) -> None:
        self.fast_loops = fast_loops
        self.graph = captured.graph
        self.walk = walk
        self.region_at: dict[tuple[str, ...], dict[str, RegionPlan]] = {}
        for r in plan.regions.get(walk.name, []):
            self.region_at.setdefault(tuple(r.path), {})[r.items[0]] = r
        nodes = ir.iter_nodes(walk.body)
        self.ops = {n.name: n for n in nodes if isinstance(n, ir.Op)}
        self.loops = {n.name: n for n in nodes if isinstance(n, ir.LoopNode)}
        self.edges = {s.name: s for s in walk.streams}

    def block(
        self,
        block: ir.Block,
        plan: BlockPlan,
        pinned: set[str],
        top: bool,
        path: tuple[str, ...] = (),
    ) -> _BlockSpec:
        nodes: list[_NodeSpec] = []
        loops: list[_LoopSpec] = []
        regions: list[_RegionSpec] = []
        planned: set[str] = set()
        starts = self.region_at.get(path, {})
        skip: set[str] = set()
        for pn in plan.nodes:
            if pn.name in skip:
                continue
            if pn.name in starts:
                region = starts[pn.name]
                skip |= set(region.items)
                regions.append(self._region(region, plan, top))
                for item in plan.nodes:
                    if item.name in region.items:
                        planned |= set(item.ops) if isinstance(item, NodePlan) else {item.name}
                continue
            if isinstance(pn, NodePlan):
                ops = []
                for name in pn.ops:
                    op = self.ops[name]
                    ops.append(_OpSpec(op, _unique(ir.node_inputs(op))))
                    planned.add(name)
                nodes.append(_NodeSpec(pn.name, tuple(ops)))
            else:
                node = self.loops[pn.name]
                body_pinned = {*node.outputs, *([node.stop] if node.stop else [])}
                body = self.block(node.body, pn.body, body_pinned, False, (*path, node.name))
                need, step = _loop_reads(node)
                loops.append(
                    _LoopSpec(node, body, need, step, self._speculative(node), node, (), {})
                )
                planned.add(node.name)
        block_ops = {n.name for n in block.nodes}
        if planned != block_ops:
            raise ValueError(
                f"the plan of walk {self.walk.name!r} does not match the captured model: "
                f"plan-only {sorted(planned - block_ops)}, IR-only {sorted(block_ops - planned)}"
            )
        streams = self._streams(block, loops)
        uses: dict[str, int] = {}
        for n in nodes:
            for o in n.ops:
                for r in o.reads:
                    uses[r] = uses.get(r, 0) + 1
        for ls in loops:
            for r in ls.need:  # step reads are among them
                uses[r] = uses.get(r, 0) + 1
        for rs in regions:
            for r in rs.reads:
                uses[r] = uses.get(r, 0) + 1
        for s in streams.values():
            if s.producer is None:  # a whole value: read by the consumer until it ends
                uses[s.edge.source] = uses.get(s.edge.source, 0) + 1
        for ls in loops:
            ls.visible = msgspec.structs.replace(
                ls.node,
                accumulated={
                    ch: acc
                    for ch, acc in ls.node.accumulated.items()
                    if uses.get(ch, 0) > 0 or ch in pinned
                },
            )
            ls.feeds = tuple(
                (name, s.edge.source) for name, s in streams.items() if s.producer == ls.node.name
            )
            ls.fast = self.fast_loops and _simple(ls)
            if top:
                ls.emit = {
                    ch: tuple(
                        out
                        for out, arg in self.walk.outputs.items()
                        if arg == ir.Ref(ch) and out not in self.walk.state
                    )
                    for ch in ls.node.accumulated
                }
        return _BlockSpec(
            tuple(block.params),
            tuple(nodes),
            tuple(loops),
            tuple(regions),
            streams,
            uses,
            frozenset(pinned),
        )

    def _region(self, region: RegionPlan, plan: BlockPlan, top: bool) -> _RegionSpec:
        emit: dict[str, tuple[str, ...]] = {}
        if top:
            for ch in region.streamed:
                emit[ch] = tuple(
                    out
                    for out, arg in self.walk.outputs.items()
                    if arg == ir.Ref(ch) and out not in self.walk.state
                )
        forwards = {
            ch: tuple(
                e.name
                for e in self.walk.streams
                if e.source == ch
                and any(e.name in r.fed for rs in self.region_at.values() for r in rs.values())
            )
            for ch in region.forwards
        }
        return _RegionSpec(
            region.name,
            tuple(region.inputs),
            tuple(region.trip_inputs),
            tuple(region.outputs),
            emit,
            forwards,
            tuple(region.fed),
        )

    def _speculative(self, node: ir.LoopNode) -> bool:
        components = [
            self.graph.components[n.target].speculative
            for n in ir.iter_nodes(node.body)
            if ir.is_component(n) and isinstance(n, ir.Op)
        ]
        return node.speculative and all(components)

    def _streams(self, block: ir.Block, loops: list[_LoopSpec]) -> dict[str, _StreamSpec]:
        by_name = {ls.node.name: ls for ls in loops}
        producers = {ch: ls.node for ls in loops for ch in ls.node.accumulated}
        out: dict[str, _StreamSpec] = {}
        for ls in loops:
            trips = ls.node.trips
            if not isinstance(trips, ir.StreamTrips):
                continue
            edge = self.edges[trips.stream]
            producer = producers.get(edge.source)
            acc = producer.accumulated[edge.source] if producer is not None else None
            waits = producer is not None and producer.name in self._ancestors(
                block, by_name, ls.need
            )
            out[edge.name] = _StreamSpec(
                edge,
                ChunkPolicy.from_json(dict(edge.policy)),
                producer.name if producer is not None else None,
                acc,
                backpressure=producer is not None and not waits,
            )
        return out

    def _ancestors(
        self, block: ir.Block, loops: dict[str, _LoopSpec], names: tuple[str, ...]
    ) -> set[str]:
        """Nodes of ``block`` that the values ``names`` depend on, transitively."""
        made_by: dict[str, ir.Node] = {}
        for n in block.nodes:
            for v in ir.node_outputs(n):
                made_by[v] = n
        seen: set[str] = set()
        todo = list(names)
        while todo:
            node = made_by.get(todo.pop())
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            todo += ir.node_inputs(node) if isinstance(node, ir.Op) else loops[node.name].need
        return seen


# ------------------------------------------------------------------------------ live state


@dataclass(eq=False)
class _Stream:
    """The buffer of one streaming edge in one frame: the producer's committed items, of
    which ``[base, n)`` are retained (one tensor piece per producer iteration)::

        stream items       0  1  2  3  4  5  6  7     n = 8 committed so far
        chunk 1 (L=2, C=3)    [1  2 |3  4  5]         context | new items
        after taking it, retain_from(2) = 2*3 - 2 = 4: items 0..3 are released
        retained                       [4  5  6  7]   base = 4, buffered = n - base = 4
    """

    spec: _StreamSpec
    pieces: deque[torch.Tensor] = field(default_factory=deque)
    sizes: deque[int] = field(default_factory=deque)
    dim: int = 0
    base: int = 0
    n: int = 0
    finished: bool = False  # the producer is done
    closed: bool = False  # the consumer is done: later items are dropped

    @property
    def buffered(self) -> int:
        return self.n - self.base

    def append(self, piece: Any) -> None:
        if self.closed:
            return
        if not isinstance(piece, torch.Tensor):
            raise LoopError(
                f"stream {self.spec.edge.name!r} carries {type(piece).__name__}, not a tensor"
            )
        acc = self.spec.acc
        if acc is not None and acc.mode == "stack":
            piece = piece.unsqueeze(acc.dim if acc.dim >= 0 else acc.dim + piece.dim() + 1)
        dim = self.spec.edge.dim if self.spec.edge.dim >= 0 else self.spec.edge.dim + piece.dim()
        if acc is not None:
            acc_dim = acc.dim if acc.dim >= 0 else acc.dim + piece.dim()
            if acc_dim != dim:
                raise LoopError(
                    f"stream {self.spec.edge.name!r} chunks along dim {dim}, but its source "
                    f"accumulates along dim {acc_dim}; streaming needs the same dim"
                )
        self.dim = dim
        self.pieces.append(piece)
        self.sizes.append(int(piece.shape[dim]))
        self.n += int(piece.shape[dim])

    def ready(self) -> int:
        return self.spec.policy.ready(self.n, self.finished)

    def chunk(self, i: int) -> tuple[torch.Tensor, ChunkSpan]:
        """Chunk ``i`` cut from the retained pieces (``ready() > i``)."""
        span = self.spec.policy.span(i, self.n, self.finished)
        parts: list[torch.Tensor] = []
        offset = pos = self.base
        for piece, size in zip(self.pieces, self.sizes):
            if pos + size <= span.start:
                offset = pos + size
            elif pos < span.stop:
                parts.append(piece)
            pos += size
        if span.start < self.base or not parts:
            raise LoopError(f"stream {self.spec.edge.name!r} released chunk {i}'s items")
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        return take(x, span, self.dim, self.spec.policy.pad_value, offset), span

    def release(self, before: int) -> None:
        """Drop items ``< before``; a piece cut in two keeps a copy of its tail only."""
        while self.pieces and self.base + self.sizes[0] <= before:
            self.base += self.sizes.popleft()
            self.pieces.popleft()
        if self.pieces and self.base < before:
            cut = before - self.base
            rest = self.sizes[0] - cut
            self.pieces[0] = self.pieces[0].narrow(self.dim, cut, rest).clone()
            self.sizes[0] = rest
            self.base = before


@dataclass(eq=False)
class _Forward:
    """A stream between two regions of one frame: the producer's committed pieces wait
    here until the consumer region is dispatched, then go to it as ``Feed``; those sent stay
    referenced until the consumer says it received them (they live on the producer's rank)."""

    stream: str
    channel: str
    pending: list[Any] = field(default_factory=list)
    sent: deque[Any] = field(default_factory=deque)
    received: int = 0  # pieces the consumer has (in ``sent`` order)
    producer: int | None = None  # region items
    consumer: int | None = None
    finished: bool = False
    finish_sent: bool = False
    credit: int | None = None  # the consumer's base + the limit, when it said


@dataclass(eq=False)
class _Frame:
    """One instance of a block: a walk body, or one iteration of a loop body."""

    spec: _BlockSpec
    path: tuple[int, ...]
    parent: _Frame | None
    env: dict[str, Any] = field(default_factory=dict)
    uses: dict[str, int] = field(default_factory=dict)
    todo: dict[str, list[int]] = field(default_factory=dict)  # node -> undispatched op indices
    regions: list[_RegionSpec] = field(default_factory=list)  # regions not dispatched
    waiting: list[_LoopSpec] = field(default_factory=list)  # loops not started
    runs: list[_LoopRun] = field(default_factory=list)  # loops started, not finished
    streams: dict[str, _Stream] = field(default_factory=dict)
    forwards: dict[str, _Forward] = field(default_factory=dict)  # streams between regions
    inflight: set[int] = field(default_factory=set)
    speculative: bool = False
    alive: bool = True
    dispatched: int = 0
    error: str | None = None

    def done(self) -> bool:
        return not (
            self.inflight
            or self.waiting
            or self.runs
            or self.regions
            or self.error
            or any(self.todo.values())
        )

    def in_speculation(self) -> bool:
        f: _Frame | None = self
        while f is not None:
            if f.speculative:
                return True
            f = f.parent
        return False


@dataclass(eq=False)
class _LoopRun:
    """One execution of a loop inside ``parent``. Iterations ``< committed`` are done;
    ``frames`` holds the live ones (at most two); stops are known false below ``known``."""

    spec: _LoopSpec
    parent: _Frame
    carried: dict[str, Any]  # carried values for the next iteration to start, by param
    fixed: dict[str, Any]
    bound: int | None  # None: a stream's chunk count, not known until the producer ends
    cap: int | None  # max_iters of a stream loop
    frames: dict[int, _Frame] = field(default_factory=dict)
    started: int = 0
    committed: int = 0
    known: int = 0
    stop_at: int | None = None  # iteration count once a stop came true
    collected: dict[str, list[Any]] = field(default_factory=dict)
    last: list[Any] | None = None  # body outputs of the last committed iteration


@dataclass(eq=False)
class _Request:
    id: str
    walk: str
    state: dict[str, Any]
    root: _Frame
    walk_inputs: dict[str, Any]
    transitions: int = 0
    sent: set[str] = field(default_factory=set)  # outputs of this walk sent before its end


@dataclass(eq=False)
class _Pending:
    request: _Request
    frame: _Frame
    node: str
    ops: tuple[str, ...]
    internal: dict[str, int]  # reads of values produced inside the item
    item: WorkItem  # as issued: ``defer`` issues it again
    region: _RegionSpec | None = None
    delivered: set[str] = field(default_factory=set)  # outputs bound (``partial``)


class _RequestFailed(Exception):
    pass


# ------------------------------------------------------------------------------ conductor


class Conductor:
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
    ) -> None:
        if stream_buffer_limit < 1:
            raise ValueError(f"stream_buffer_limit must be >= 1, got {stream_buffer_limit}")
        self.captured = captured
        self.speculate = speculate
        self.stream_buffer_limit = stream_buffer_limit
        self.eager_outputs = eager_outputs
        self._walks: dict[str, _BlockSpec] = {}
        for name, walk in captured.graph.walks.items():
            if name not in plan.walks:
                raise ValueError(f"the plan has no walk {name!r}; was it lowered from this model?")
            pinned = {r for a in walk.outputs.values() for r in ir.arg_refs(a)}
            builder = _SpecBuilder(captured, walk, plan, fast_loops)
            spec = builder.block(walk.body, plan.walks[name], pinned, True)
            self._walks[name] = spec
            self._check_streams(name, spec)
        self._interp = Interpreter(captured)
        self._requests: dict[str, _Request] = {}
        self._items: dict[int, _Pending] = {}
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

    def _check_streams(self, walk: str, spec: _BlockSpec) -> None:
        for s in spec.streams.values():
            need = _min_buffer(s.policy)
            if s.backpressure and self.stream_buffer_limit < need:
                raise ValueError(
                    f"stream_buffer_limit={self.stream_buffer_limit} cannot hold one chunk of "
                    f"stream {s.edge.name!r} of walk {walk!r} ({s.policy.to_json()}); "
                    f"use at least {need}"
                )
        for ls in spec.loops:
            self._check_streams(walk, ls.body)

    # ------------------------------------------------------------------ the interface

    def submit(self, request_id: str, inputs: Mapping[str, Any], walk: str | None = None) -> None:
        """Start a request at ``walk`` (default: the model's first entry walk)."""
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
        req = _Request(request_id, walk, dict(inputs), _Frame(self._walks[walk], (), None), {})
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
        p = self._take(item_id)
        if p is None:
            return
        need = [op for op in p.item.outputs if op not in p.delivered]
        missing = [op for op in need if op not in value] if isinstance(value, Mapping) else need
        if missing:
            self._node_failed(p, f"result has no value for ops {list(missing)}")
            return
        self._bind_results(p, value)
        if p.region is not None:
            for streams in p.region.forwards.values():
                for stream in streams:
                    fwd = p.frame.forwards[stream]
                    fwd.finished = True
                    self._flush(p.request, fwd)
        self._advance(p.request)

    def partial(self, item_id: int, values: Mapping[str, Any]) -> None:
        """Some outputs of a region item, before its exit: bound at once (``complete`` then
        brings the others). Items no longer wanted: ignored."""
        p = self._items.get(item_id)
        if p is None or p.region is None:
            return
        self._bind_results(p, {k: v for k, v in values.items() if k in p.ops})
        self._advance(p.request)

    def _bind_results(self, p: _Pending, value: Mapping[str, Any]) -> None:
        frame = p.frame
        for op in p.ops:
            if op in p.delivered or (p.region is not None and op not in value):
                continue
            p.delivered.add(op)
            left = frame.uses.get(op, 0) - p.internal.get(op, 0)
            frame.uses[op] = left
            if left > 0 or op in frame.spec.pinned:
                frame.env[op] = value[op]

    def streamed(self, item_id: int, channel: str, index: int, value: Any) -> None:
        """Iteration ``index`` of a region item's streamed channel ``channel`` committed (its
        walk-level client outputs stream it). Items no longer wanted: ignored."""
        p = self._items.get(item_id)
        if p is None or p.region is None:
            return
        outs = p.region.emit.get(channel)
        streams = p.region.forwards.get(channel)
        if outs is None and streams is None:
            self._node_failed(p, f"region {p.node} streamed {channel!r}, which it does not stream")
            return
        req = p.request
        for out in outs or ():
            self._send_ready_outputs(req)
            self._events.append(StreamItem(req.id, out, index, value))
        for stream in streams or ():
            fwd = p.frame.forwards[stream]
            fwd.pending.append(value)
            self._flush(req, fwd)

    def consumed(self, item_id: int, stream: str, base: int, received: int, closed: bool) -> None:
        """Consumer region item ``item_id`` has ``received`` pieces of ``stream`` and has
        released its items before ``base`` (``closed``: it takes no more): its producer may
        commit up to ``base + stream_buffer_limit`` items (``Credit``)."""
        p = self._items.get(item_id)
        if p is None or p.region is None or stream not in p.region.fed:
            return
        fwd = p.frame.forwards[stream]
        while fwd.received < received and fwd.sent:
            fwd.sent.popleft()
            fwd.received += 1
        credit = UNLIMITED if closed else base + self.stream_buffer_limit
        if fwd.producer is not None and credit != fwd.credit:
            fwd.credit = credit
            others = [
                g.credit if g.credit is not None else self.stream_buffer_limit
                for g in p.frame.forwards.values()
                if g.channel == fwd.channel
            ]
            self._credits.append(Credit(fwd.producer, p.request.id, fwd.channel, min(others)))

    def feed(self, request_id: str, stream: str, pieces: Sequence[Any], finished: bool) -> None:
        """Items of fed stream ``stream`` of a request's walk (its root frame), in order."""
        req = self._requests.get(request_id)
        if req is None:
            return
        s = req.root.streams.get(stream)
        if s is None or stream not in self._fed.get(req.walk, frozenset()):
            self._fail_request(req, f"walk {req.walk!r} is fed no stream {stream!r}")
            return
        try:
            for piece in pieces:
                s.append(piece)
        except LoopError as e:
            self._fail_request(req, str(e))
            return
        s.finished = s.finished or finished
        self._advance(req)

    def fed_progress(self, request_id: str) -> dict[str, tuple[int, bool]]:
        """(items released, consumer done) of every fed stream of the request."""
        req = self._requests.get(request_id)
        if req is None:
            return {}
        fed = self._fed.get(req.walk, frozenset())
        return {n: (s.base, s.closed) for n, s in req.root.streams.items() if n in fed}

    def credit(self, request_id: str, channel: str, items: int) -> None:
        """The request's walk-level loops may commit items of client channel ``channel`` up to
        ``items`` (counting iterations in flight as one item each), then wait for more."""
        if request_id not in self._requests:
            return
        self._credit.setdefault(request_id, {})[channel] = items
        self._advance(self._requests[request_id])

    def feeds(self) -> list[Feed]:
        """Stream items for consumer regions (drained)."""
        out, self._feeds = self._feeds, []
        return out

    def credits(self) -> list[Credit]:
        """Credit for producer regions (drained)."""
        out, self._credits = self._credits, []
        return out

    def dropped(self) -> list[int]:
        """Region items released (cancel, failure, a discarded speculative iteration) before
        their rank reported their exit: the runner may stop them. Drained."""
        out, self._dropped = self._dropped, []
        return out

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
        by_request = {rid: _count_values(req) for rid, req in self._requests.items()}
        return ConductorStats(
            speculated_steps=self._speculated,
            wasted_steps=self._wasted,
            live_requests=len(self._requests),
            in_flight=len(self._items),
            buffered_stream_items=sum(
                s.buffered for req in self._requests.values() for s in _streams(req.root)
            ),
            live_values=sum(by_request.values()),
            live_values_by_request=by_request,
            deferred_items=self.deferred_items,
        )

    # ------------------------------------------------------------------ requests and walks

    def _check_inputs(self, walk: str, inputs: Mapping[str, Any]) -> None:
        """The walk's inputs, and along a static ``next`` chain every later walk's inputs
        that no earlier walk outputs, must be given."""
        graph = self.captured.graph
        have = set(inputs)
        seen: set[str] = set()
        current: str | None = walk
        while current is not None and current not in seen:
            w = graph.walks[current]
            missing = [i.name for i in w.inputs if i.name not in have and i.default is None]
            if missing:
                raise ValueError(f"walk {current!r} needs inputs {missing}")
            have |= set(w.outputs)
            seen.add(current)
            current = None if graph.custom_transition else w.next

    def _enter_walk(self, req: _Request, walk: str) -> None:
        w = self.captured.graph.walks[walk]
        given = ir.with_defaults(w, req.state)
        missing = [i.name for i in w.inputs if i.name not in given]
        if missing:
            raise _RequestFailed(f"walk {walk!r} needs inputs {missing}")
        req.walk = walk
        req.walk_inputs = {i.name: given[i.name] for i in w.inputs}
        req.sent = set()
        req.root = self._new_frame(self._walks[walk], (), None, req.walk_inputs)

    def _finish_walk(self, req: _Request) -> None:
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
            raise _RequestFailed(f"more than {MAX_TRANSITIONS} walk transitions")
        self._kill(req.root)
        self._enter_walk(req, nxt)

    def _send_ready_outputs(self, req: _Request) -> None:
        """Walk outputs whose values exist already (a prefill's first token, while the decode
        loop streams the next ones) as ``Output`` events, each once per walk, so that a client
        reading a stream has them before the stream's items."""
        w = self.captured.graph.walks[req.walk]
        env = req.root.env
        for k, a in w.outputs.items():
            if k in req.sent or k in w.state or not all(r in env for r in ir.arg_refs(a)):
                continue
            req.sent.add(k)
            self._events.append(Output(req.id, w.name, k, self._interp.value(a, env)))

    def _advance(self, req: _Request) -> None:
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
        except (_RequestFailed, LoopError) as e:
            self._fail_request(req, str(e))
        except Exception as e:  # a bad request never takes the conductor down
            self._fail_request(req, f"{type(e).__name__}: {e}")

    def _fail_request(self, req: _Request, error: str) -> None:
        if self._requests.get(req.id) is req:
            self._events.append(Failed(req.id, error))
            self._release(req)

    def _release(self, req: _Request) -> None:
        self._credit.pop(req.id, None)
        self._produced.pop(req.id, None)
        self._kill(req.root)
        req.state.clear()
        req.walk_inputs.clear()
        del self._requests[req.id]

    def _take(self, item_id: int) -> _Pending | None:
        p = self._items.pop(item_id, None)
        if p is None:
            if not 0 <= item_id < self._next_id:
                raise KeyError(f"no work item {item_id} was ever issued")
            return None  # released, discarded, or reported before
        p.frame.inflight.discard(item_id)
        return p

    def _node_failed(self, p: _Pending, error: str) -> None:
        walk = p.request.walk.partition("@")[0]  # a region walk names its walk first
        message = (
            error if p.region is not None else f"node {p.node} of walk {walk!r} failed: {error}"
        )
        if p.frame.in_speculation():
            p.frame.error = p.frame.error or message  # decided when the iteration is
        else:
            self._fail_request(p.request, message)

    # ------------------------------------------------------------------ frames and ops

    def _new_frame(
        self, spec: _BlockSpec, path: tuple[int, ...], parent: _Frame | None, values: dict[str, Any]
    ) -> _Frame:
        f = _Frame(spec, path, parent, uses=dict(spec.uses))
        f.todo = {n.name: list(range(len(n.ops))) for n in spec.nodes}
        f.regions = list(spec.regions)
        for rs in spec.regions:
            for ch, streams in rs.forwards.items():
                for stream in streams:
                    f.forwards[stream] = _Forward(stream, ch)
        f.waiting = list(spec.loops)
        f.streams = {name: _Stream(s) for name, s in spec.streams.items()}
        for name, value in values.items():
            self._bind(f, name, value)
        return f

    @staticmethod
    def _bind(f: _Frame, name: str, value: Any) -> None:
        if f.uses.get(name, 0) > 0 or name in f.spec.pinned:
            f.env[name] = value

    @staticmethod
    def _consume(f: _Frame, name: str) -> None:
        left = f.uses.get(name, 0) - 1
        f.uses[name] = left
        if left <= 0 and name not in f.spec.pinned:
            f.env.pop(name, None)

    def _pump(self, req: _Request, f: _Frame) -> bool:
        """One pass over a frame: fill whole-value streams, start loops, dispatch ops,
        advance its loops. True if anything changed."""
        changed = False
        fed = self._fed.get(req.walk, frozenset())
        for s in f.streams.values():
            if s.spec.edge.name in fed:
                continue
            if s.spec.producer is None and not s.finished and s.spec.edge.source in f.env:
                s.append(f.env[s.spec.edge.source])
                s.finished = changed = True
        for ls in list(f.waiting):
            if all(r in f.env for r in ls.need):
                self._start_loop(req, f, ls)
                changed = True
        for node in f.spec.nodes:
            if f.todo[node.name]:
                changed |= self._dispatch(req, f, node)
        for rs in list(f.regions):
            if all(r in f.env for r in rs.reads):
                self._dispatch_region(req, f, rs)
                changed = True
        for run in list(f.runs):
            changed |= self._pump_loop(req, run)
        return changed

    def _dispatch(self, req: _Request, f: _Frame, node: _NodeSpec) -> bool:
        """Queue the node's undispatched ops whose inputs exist, as one item."""
        chosen: list[int] = []
        made: set[str] = set()
        internal: dict[str, int] = {}
        for k in f.todo[node.name]:
            spec = node.ops[k]
            if all(r in f.env or r in made for r in spec.reads):
                chosen.append(k)
                made.add(spec.op.name)
        if not chosen:
            return False
        ops = [node.ops[k] for k in chosen]
        f.todo[node.name] = [k for k in f.todo[node.name] if k not in chosen]
        first = ops[0].op
        kind: NodeKind = "component" if first.kind == "component" else "glue"
        call = None
        if kind == "component":
            call = (
                [self._interp.value(a, f.env) for a in first.args],
                {k: self._interp.value(a, f.env) for k, a in first.kwargs.items()},
            )
        env: dict[str, Any] = {}
        produced: set[str] = set()
        for spec in ops:
            for r in spec.reads:
                if r in produced:
                    internal[r] = internal.get(r, 0) + 1
                elif spec.op.kind == "glue":
                    env[r] = f.env[r]
            produced.add(spec.op.name)
        for spec in ops:  # release after materializing: an op may read a value twice
            for r in spec.reads:
                if r not in produced:
                    self._consume(f, r)
        outputs = tuple(  # what complete() keeps: read after this item, or pinned
            s.op.name
            for s in ops
            if f.uses.get(s.op.name, 0) - internal.get(s.op.name, 0) > 0
            or s.op.name in f.spec.pinned
        )
        item = WorkItem(
            id=next(self._ids),
            request=req.id,
            walk=req.walk,
            node=node.name,
            kind=kind,
            ops=tuple(s.op.name for s in ops),
            frame=f.path,
            speculative=f.in_speculation(),
            call=call,
            env=env,
            outputs=outputs,
        )
        self._next_id = item.id + 1
        self._items[item.id] = _Pending(req, f, node.name, item.ops, internal, item)
        f.inflight.add(item.id)
        f.dispatched += 1
        self._queue.append(item)
        return True

    def _dispatch_region(self, req: _Request, f: _Frame, rs: _RegionSpec) -> None:
        """Hand region ``rs`` to its rank: one item, its inputs in ``env``."""
        f.regions.remove(rs)
        env = {r: f.env[r] for r in rs.reads}
        for t in rs.trip_inputs:
            env[t] = req.walk_inputs[t]
        for r in rs.reads:
            self._consume(f, r)
        item = WorkItem(
            id=next(self._ids),
            request=req.id,
            walk=req.walk,
            node=rs.name,
            kind="region",
            ops=(),
            frame=f.path,
            speculative=f.in_speculation(),
            env=env,
            outputs=rs.outputs,
        )
        self._next_id = item.id + 1
        self._items[item.id] = _Pending(req, f, rs.name, rs.outputs, {}, item, rs)
        f.inflight.add(item.id)
        f.dispatched += 1
        self._queue.append(item)
        for stream in rs.fed:
            fwd = f.forwards[stream]
            fwd.consumer = item.id
            self._flush(req, fwd)
        for streams in rs.forwards.values():
            for stream in streams:
                f.forwards[stream].producer = item.id

    def _flush(self, req: _Request, fwd: _Forward) -> None:
        if fwd.consumer is None or not (fwd.pending or (fwd.finished and not fwd.finish_sent)):
            return
        pieces = tuple(fwd.pending)
        fwd.sent.extend(pieces)
        fwd.pending = []
        fwd.finish_sent = fwd.finished
        self._feeds.append(Feed(fwd.consumer, req.id, fwd.stream, pieces, fwd.finished))

    def _kill(self, f: _Frame) -> int:
        """Release a frame and everything under it; returns how many items it dispatched."""
        f.alive = False
        for item_id in f.inflight:
            p = self._items.pop(item_id, None)
            if p is not None and p.region is not None:
                self._dropped.append(item_id)
        f.inflight.clear()
        n = f.dispatched
        for run in f.runs:
            for sub in run.frames.values():
                n += self._kill(sub)
            run.frames.clear()
        f.runs.clear()
        f.env.clear()
        f.streams.clear()
        return n

    # ------------------------------------------------------------------ loops

    def _start_loop(self, req: _Request, f: _Frame, ls: _LoopSpec) -> None:
        if ls.fast:
            self._dispatch_loop(req, f, ls)
            return
        node = ls.node
        carried = {
            p.name: self._interp.value(p.role.init, f.env)
            for p in node.params
            if isinstance(p.role, ir.Carried)
        }
        fixed = {
            p.name: self._interp.value(p.role.value, f.env)
            for p in node.params
            if isinstance(p.role, ir.Invariant)
        }
        bound: int | None = None
        cap: int | None = None
        if not isinstance(node.trips, ir.StreamTrips):
            bound = loop_bound(node, req.walk_inputs, None)
        elif isinstance(node.max_iters, int):
            cap = node.max_iters
        elif node.max_iters is not None:
            cap = int_input(req.walk_inputs, node.max_iters)
        run = _LoopRun(ls, f, carried, fixed, bound, cap)
        run.collected = {ch: [] for ch in ls.visible.accumulated}
        f.waiting.remove(ls)
        f.runs.append(run)
        for r in ls.need:
            if r not in ls.step_reads:
                self._consume(f, r)

    def _dispatch_loop(self, req: _Request, f: _Frame, ls: _LoopSpec) -> None:
        """Hand simple loop ``ls`` to the runner: one item, its start values in ``loop``."""
        node = ls.node
        value = self._interp.value
        carried, fixed, sources = {}, {}, {}
        for p in node.params:
            role = p.role
            if isinstance(role, ir.Carried):
                carried[p.name] = value(role.init, f.env)
            elif isinstance(role, ir.Invariant):
                fixed[p.name] = value(role.value, f.env)
            elif isinstance(role.source, ir.SelectStep):
                sources[p.name] = value(role.source.source, f.env)
            elif isinstance(role.source, ir.TableStep):
                sources[p.name] = [value(v, f.env) for v in role.source.values]
        channels = tuple(ch for ch in ls.visible.channels())
        start = LoopStart(
            node.name,
            loop_bound(node, req.walk_inputs, None),
            carried,
            fixed,
            sources,
            channels,
            tuple(ls.emit),
        )
        f.waiting.remove(ls)
        for r in ls.need:
            self._consume(f, r)
        item = WorkItem(
            id=next(self._ids),
            request=req.id,
            walk=req.walk,
            node=node.name,
            kind="loop",
            ops=(),
            frame=f.path,
            speculative=f.in_speculation(),
            outputs=channels,
            loop=start,
        )
        self._next_id = item.id + 1
        spec = _RegionSpec(node.name, (), (), channels, ls.emit, {}, ())
        self._items[item.id] = _Pending(req, f, node.name, channels, {}, item, spec)
        f.inflight.add(item.id)
        f.dispatched += 1
        self._queue.append(item)

    def _pump_loop(self, req: _Request, run: _LoopRun) -> bool:
        changed = self._settle(req, run)
        if run not in run.parent.runs:
            return changed
        for sub in list(run.frames.values()):
            if sub.alive:
                changed |= self._pump(req, sub)
        if self._can_start(req, run):
            self._start_iteration(run)
            changed = True
        return self._settle(req, run) or changed

    def _can_start(self, req: _Request, run: _LoopRun) -> bool:
        ls, i = run.spec, run.started
        if run.stop_at is not None or len(run.frames) >= 2:
            return False
        if (run.bound is not None and i >= run.bound) or (run.cap is not None and i >= run.cap):
            return False
        trips = ls.node.trips
        if isinstance(trips, ir.StreamTrips) and run.parent.streams[trips.stream].ready() <= i:
            return False
        if ls.node.stop is not None:
            ahead = 1 if (self.speculate and ls.speculative) else 0
            if i > run.known + ahead:
                return False
        prev = run.frames.get(i - 1)
        if prev is not None:
            outs = ls.node.outputs
            needed = [outs[p.role.output] for p in ls.node.params if isinstance(p.role, ir.Carried)]
            if not all(o in prev.env for o in needed):
                return False
        for stream, _ in ls.feeds:  # iterations in flight count as one item each
            s = run.parent.streams[stream]
            full = s.buffered + len(run.frames) >= self.stream_buffer_limit
            if s.spec.backpressure and not s.closed and full:
                return False
        credit = self._credit.get(req.id)
        if credit and ls.emit:
            produced = self._produced.get(req.id, {})
            for ch in ls.emit:
                if ch in credit and produced.get(ch, 0) + len(run.frames) >= credit[ch]:
                    return False
        return True

    def _start_iteration(self, run: _LoopRun) -> None:
        ls, i, parent = run.spec, run.started, run.parent
        node = ls.node
        prev = run.frames.get(i - 1)
        values: dict[str, Any] = {}
        chunks: dict[str, tuple[torch.Tensor, ChunkSpan]] = {}
        for p in node.params:
            role = p.role
            if isinstance(role, ir.Carried):
                values[p.name] = (
                    prev.env[node.outputs[role.output]] if prev is not None else run.carried[p.name]
                )
            elif isinstance(role, ir.Invariant):
                values[p.name] = run.fixed[p.name]
            elif isinstance(role.source, ir.ChunkStep):
                src = role.source
                if src.stream not in chunks:
                    chunks[src.stream] = parent.streams[src.stream].chunk(i)
                data, span = chunks[src.stream]
                values[p.name] = data if src.part == "data" else span.context
            else:
                values[p.name] = step_value(
                    role, i, lambda a: self._interp.value(a, parent.env), None
                )
        for stream in chunks:
            s = parent.streams[stream]
            s.release(s.spec.policy.retain_from(i + 1))
        speculative = node.stop is not None and i > run.known
        if speculative:
            self._speculated += 1
        frame = self._new_frame(ls.body, (*parent.path, i), parent, values)
        frame.speculative = speculative
        run.frames[i] = frame
        run.started += 1

    def _settle(self, req: _Request, run: _LoopRun) -> bool:
        """Evaluate stops in order, commit complete iterations in order, finish the loop."""
        changed = False
        node = run.spec.node
        while node.stop is not None and run.stop_at is None:
            k = run.known
            f = run.frames.get(k)
            if f is None or node.stop not in f.env:
                break
            changed = True
            if truth(f.env[node.stop], node):
                run.stop_at = k + 1
                for j in [j for j in run.frames if j > k]:
                    if self._kill(run.frames.pop(j)):
                        self._wasted += 1
                run.started = k + 1
            else:
                run.known = k + 1
                nxt = run.frames.get(k + 1)
                if nxt is not None:
                    nxt.speculative = False
                    if not nxt.in_speculation():
                        error = _first_error(nxt)
                        if error is not None:
                            raise _RequestFailed(error)
        while True:
            f = run.frames.get(run.committed)
            if f is None or not f.done():
                break
            self._commit(req, run, f)
            changed = True
        if run.bound is None and isinstance(node.trips, ir.StreamTrips):
            s = run.parent.streams[node.trips.stream]
            if s.finished:
                run.bound = loop_bound(node, req.walk_inputs, s.ready())
        end = run.stop_at if run.stop_at is not None else run.bound
        if end is not None and run.committed >= end:
            self._finish_loop(run)
            changed = True
        return changed

    def _commit(self, req: _Request, run: _LoopRun, f: _Frame) -> None:
        ls, i = run.spec, run.committed
        node = ls.node
        outs = [f.env[o] for o in node.outputs]
        credit = self._credit.get(req.id)
        for ch, acc in node.accumulated.items():
            piece = outs[acc.output]
            if ch in run.collected:
                run.collected[ch].append(piece)
            if credit and ch in credit:
                produced = self._produced.setdefault(req.id, {})
                produced[ch] = produced.get(ch, 0) + piece_items(piece, acc)
            for out in ls.emit.get(ch, ()):
                self._send_ready_outputs(req)
                self._events.append(StreamItem(req.id, out, i, piece))
        for stream, ch in ls.feeds:
            run.parent.streams[stream].append(outs[node.accumulated[ch].output])
        run.last = outs
        run.carried = {
            p.name: outs[p.role.output] for p in node.params if isinstance(p.role, ir.Carried)
        }
        del run.frames[i]
        self._kill(f)
        run.committed += 1

    def _finish_loop(self, run: _LoopRun) -> None:
        node, parent = run.spec.node, run.parent
        if run.committed == 0 and node.accumulated:  # as the interpreter, kept or not
            ch = next(iter(node.accumulated))
            raise LoopError(f"loop {node.name} ran no iteration, so {ch} is empty")
        channels = loop_channels(run.spec.visible, run.carried, run.last, run.collected)
        for ch, value in channels.items():
            self._bind(parent, ch, value)
        for stream, _ in run.spec.feeds:
            parent.streams[stream].finished = True
        for r in run.spec.step_reads:
            self._consume(parent, r)
        if isinstance(node.trips, ir.StreamTrips):
            s = parent.streams[node.trips.stream]
            s.closed = True
            s.release(s.n)
            if s.spec.producer is None:
                self._consume(parent, s.spec.edge.source)
        parent.runs.remove(run)


# ------------------------------------------------------------------------------ helpers


def _simple(ls: _LoopSpec) -> bool:
    """A loop the runner may step by itself: a straight body of nodes, no stream in or out."""
    body = ls.body
    return (
        not body.loops
        and not body.regions
        and not body.streams
        and not ls.feeds
        and not isinstance(ls.node.trips, ir.StreamTrips)
        and not any(
            isinstance(p.role, ir.PerStep) and isinstance(p.role.source, ir.ChunkStep)
            for p in ls.node.params
        )
    )


def piece_items(piece: Any, acc: ir.Accumulated) -> int:
    """Stream items one committed piece adds (cat: its length along the dim; stack: one)."""
    if acc.mode == "stack" or not isinstance(piece, torch.Tensor):
        return 1
    shape = piece.shape
    return int(shape[acc.dim if acc.dim >= 0 else acc.dim + len(shape)])


def _first_error(f: _Frame) -> str | None:
    """The first deferred error of ``f`` or a frame under it that is not speculative."""
    if f.error is not None:
        return f.error
    for run in f.runs:
        for sub in run.frames.values():
            error = None if sub.speculative else _first_error(sub)
            if error is not None:
                return error
    return None


def _streams(f: _Frame) -> list[_Stream]:
    out = list(f.streams.values())
    for run in f.runs:
        for sub in run.frames.values():
            out += _streams(sub)
    return out


def _count_values(req: _Request) -> int:
    def frame(f: _Frame) -> int:
        n = len(f.env) + sum(len(s.pieces) for s in f.streams.values())
        for run in f.runs:
            n += len(run.carried) + len(run.fixed) + len(run.last or ())
            n += sum(len(v) for v in run.collected.values())
            n += sum(frame(sub) for sub in run.frames.values())
        return n

    return len(req.state) + frame(req.root) if req.root.alive else len(req.state)
