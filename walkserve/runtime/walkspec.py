"""Walk specs: a walk's IR and plan turned, once, into what the conductor steps through.

Owns the static side of the conductor: per block, its dispatch units (``NodeSpec``: a plan
node's ops and what each reads), its loops (``LoopSpec``: what a loop needs to start, reads per
step, which streams it feeds, which client outputs its channels stream, whether a rank may step
it whole), its regions (``RegionSpec``) and its streams (``StreamSpec``), and how many readers
each value has (``BlockSpec.uses``). Built by ``SpecBuilder`` from a ``CapturedModel`` walk and
its ``ExecutablePlan``; read-only afterwards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import msgspec

from walkserve.capture import dataflow, ir
from walkserve.capture.chunk import ChunkPolicy, FixedChunk, LeftContext, SlidingWindow
from walkserve.capture.model import CapturedModel
from walkserve.lowering.plan import BlockPlan, ExecutablePlan, NodePlan, RegionPlan

MAP_AHEAD = 8  # iterations in flight of a loop whose iterations depend on nothing of each other


@dataclass(frozen=True)
class OpSpec:
    op: ir.Op
    reads: tuple[str, ...]  # names of the values it reads (each once)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    ops: tuple[OpSpec, ...]


@dataclass(frozen=True)
class RegionSpec:
    """A region its rank runs by itself (``RegionPlan``): a node with many outputs."""

    name: str
    reads: tuple[str, ...]  # values of the block it needs to start
    trip_inputs: tuple[str, ...]  # walk inputs its loops' bounds name
    outputs: tuple[str, ...]
    emit: dict[str, tuple[str, ...]]  # streamed channel -> client outputs (walk level)
    forwards: dict[str, tuple[str, ...]]  # channel -> the streams it feeds (other regions)
    fed: tuple[str, ...]  # streams it consumes from other regions
    feeds: tuple[tuple[str, str], ...] = ()  # (stream, channel): streams of its own frame


@dataclass(frozen=True)
class StreamSpec:
    edge: ir.StreamEdge
    policy: ChunkPolicy
    producer: str | None  # the sibling loop (or region) whose accumulated channel is the source
    acc: ir.Accumulated | None
    backpressure: bool  # False where the consumer cannot start before the producer ends


@dataclass(eq=False)
class LoopSpec:
    node: ir.LoopNode
    body: BlockSpec
    need: tuple[str, ...]  # outer values needed to start (init, invariant, select, table)
    step_reads: tuple[str, ...]  # outer values read per iteration, released at the end
    speculative: bool  # the loop and every component of its body allow speculation
    visible: ir.LoopNode  # the loop as its block reads it: unread accumulations left out
    feeds: tuple[tuple[str, str], ...]  # (stream, channel) pairs this loop produces into
    emit: dict[str, tuple[str, ...]]  # accumulated channel -> client outputs (walk level)
    fast: bool = False  # handed to the runner whole (``fast_loops``): a simple loop

    @functools.cached_property
    def ahead(self) -> int:
        """Iterations it may have started and not committed: ``MAP_AHEAD`` for a map over its
        per-step inputs (no carried value, no stop, every component of it speculative, so
        that no iteration depends on another: a window decoder over a stream's chunks), so
        that the chunks that are ready run as one batched call; else 2 (the next iteration
        prepared, or speculated, while the current one runs)."""
        node = self.node
        carried = any(isinstance(p.role, ir.Carried) for p in node.params)
        return MAP_AHEAD if self.speculative and not carried and node.stop is None else 2

    @functools.cached_property
    def fast_item(self) -> tuple[tuple[str, ...], RegionSpec]:
        """A fast loop's item, as its every run is: the channels it defines, and the region
        it is to the conductor (the same for every request)."""
        channels = tuple(self.visible.channels())
        return channels, RegionSpec(self.node.name, (), (), channels, self.emit, {}, (), self.feeds)

    @functools.cached_property
    def map_node(self) -> NodeSpec | None:
        """Its one node, where the loop is a map (``ahead``: no iteration depends on another)
        whose iterations may go out as one item (``Conductor(maps=...)``): a flat body whose
        node calls a component on the loop's parameters alone, whose glue reads only what
        the node makes, and which makes every value the loop takes from an iteration."""
        if not self.flat or self.ahead != MAP_AHEAD:
            return None
        (node,) = self.body.nodes
        first = node.ops[0].op
        made = {s.op.name for s in node.ops}
        params = {p.name for p in self.node.params}
        args = [*first.args, *first.kwargs.values()]
        if (
            first.kind != "component"
            or not {r for a in args for r in dataflow.arg_refs(a)} <= params
        ):
            return None
        if any(not set(s.reads) <= made for s in node.ops[1:]):
            return None
        return node if set(self.node.outputs) <= made else None

    @functools.cached_property
    def flat(self) -> bool:
        """Its body is one node and nothing else (no loop, region or stream inside): an
        iteration's frame has all it reads when it starts, so its node is dispatched then, and
        the frame has nothing more to do until the item completes (it is not pumped again)."""
        body = self.body
        return len(body.nodes) == 1 and not (body.loops or body.regions or body.streams)


@dataclass(eq=False)
class BlockSpec:
    params: tuple[str, ...]
    nodes: tuple[NodeSpec, ...]
    loops: tuple[LoopSpec, ...]
    regions: tuple[RegionSpec, ...]
    streams: dict[str, StreamSpec]  # streams between loops of this block, by name
    uses: dict[str, int]  # readers of each value: ops, loop starts, loop ends
    pinned: frozenset[str]  # values kept until the frame ends (block outputs, stop)


def unique(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def loop_reads(node: ir.LoopNode) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(needed to start, read per step) outer values of a loop; stream sources excluded."""
    need: list[str] = []
    step: list[str] = []
    for p in node.params:
        role = p.role
        if isinstance(role, ir.Carried):
            need += dataflow.arg_refs(role.init)
        elif isinstance(role, ir.Invariant):
            need += dataflow.arg_refs(role.value)
        elif isinstance(role.source, ir.SelectStep):
            step += dataflow.arg_refs(role.source.source)
        elif isinstance(role.source, ir.TableStep):
            step += [r for v in role.source.values for r in dataflow.arg_refs(v)]
    return unique(need + step), unique(step)


def min_buffer(policy: ChunkPolicy) -> int:
    """Items a buffer must hold for the consumer's next chunk to become ready."""
    if isinstance(policy, FixedChunk):
        return policy.size
    if isinstance(policy, LeftContext):
        return policy.context + max(policy.chunk, policy.first_size)
    assert isinstance(policy, SlidingWindow)
    return policy.window


class SpecBuilder:
    """Builds the ``BlockSpec`` tree of one walk from its IR and its plan."""

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
        nodes = dataflow.iter_nodes(walk.body)
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
    ) -> BlockSpec:
        nodes: list[NodeSpec] = []
        loops: list[LoopSpec] = []
        regions: list[RegionSpec] = []
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
                    ops.append(OpSpec(op, unique(dataflow.node_inputs(op))))
                    planned.add(name)
                nodes.append(NodeSpec(pn.name, tuple(ops)))
            else:
                node = self.loops[pn.name]
                body_pinned = {*node.outputs, *([node.stop] if node.stop else [])}
                body = self.block(node.body, pn.body, body_pinned, False, (*path, node.name))
                need, step = loop_reads(node)
                loops.append(
                    LoopSpec(node, body, need, step, self._speculative(node), node, (), {})
                )
                planned.add(node.name)
        block_ops = {n.name for n in block.nodes}
        if planned != block_ops:
            raise ValueError(
                f"the plan of walk {self.walk.name!r} does not match the captured model: "
                f"plan-only {sorted(planned - block_ops)}, IR-only {sorted(block_ops - planned)}"
            )
        streams = self._streams(block, loops, regions)
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
            ls.fast = self.fast_loops and simple_loop(ls)
            if top:
                ls.emit = {
                    ch: tuple(
                        out
                        for out, arg in self.walk.outputs.items()
                        if arg == ir.Ref(ch) and out not in self.walk.state
                    )
                    for ch in ls.node.accumulated
                }
        return BlockSpec(
            tuple(block.params),
            tuple(nodes),
            tuple(loops),
            tuple(regions),
            streams,
            uses,
            frozenset(pinned),
        )

    def _region(self, region: RegionPlan, plan: BlockPlan, top: bool) -> RegionSpec:
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
        edges = {e.name: e for e in self.walk.streams}
        return RegionSpec(
            region.name,
            tuple(region.inputs),
            tuple(region.trip_inputs),
            tuple(region.outputs),
            emit,
            forwards,
            tuple(region.fed),
            tuple((name, edges[name].source) for name in region.feeds),
        )

    def _speculative(self, node: ir.LoopNode) -> bool:
        components = [
            self.graph.components[n.target].speculative
            for n in dataflow.iter_nodes(node.body)
            if dataflow.is_component(n) and isinstance(n, ir.Op)
        ]
        return node.speculative and all(components)

    def _streams(
        self, block: ir.Block, loops: list[LoopSpec], regions: list[RegionSpec]
    ) -> dict[str, StreamSpec]:
        by_name = {ls.node.name: ls for ls in loops}
        producers = {ch: ls.node for ls in loops for ch in ls.node.accumulated}
        fed_by = {stream: rs for rs in regions for stream, _ in rs.feeds}
        out: dict[str, StreamSpec] = {}
        for ls in loops:
            trips = ls.node.trips
            if not isinstance(trips, ir.StreamTrips):
                continue
            edge = self.edges[trips.stream]
            producer = producers.get(edge.source)
            region = fed_by.get(edge.name)
            if region is not None:  # a region's loop feeds it item by item (its ``feeds``)
                loop = next(n for n in self.loops.values() if edge.source in n.accumulated)
                waits = bool(set(region.outputs) & self._needs(block, by_name, ls.need))
                out[edge.name] = StreamSpec(
                    edge,
                    ChunkPolicy.from_json(dict(edge.policy)),
                    region.name,
                    loop.accumulated[edge.source],
                    backpressure=not waits,
                )
                continue
            acc = producer.accumulated[edge.source] if producer is not None else None
            waits = producer is not None and producer.name in self._ancestors(
                block, by_name, ls.need
            )
            out[edge.name] = StreamSpec(
                edge,
                ChunkPolicy.from_json(dict(edge.policy)),
                producer.name if producer is not None else None,
                acc,
                backpressure=producer is not None and not waits,
            )
        return out

    def _needs(
        self, block: ir.Block, loops: dict[str, LoopSpec], names: tuple[str, ...]
    ) -> set[str]:
        """The values ``names`` depend on in ``block``, transitively (themselves included),
        through its ops and conductor-driven loops (a region's outputs end the search)."""
        return self._depends(block, loops, names)[1]

    def _ancestors(
        self, block: ir.Block, loops: dict[str, LoopSpec], names: tuple[str, ...]
    ) -> set[str]:
        """Nodes of ``block`` that the values ``names`` depend on, transitively."""
        return self._depends(block, loops, names)[0]

    @staticmethod
    def _depends(
        block: ir.Block, loops: dict[str, LoopSpec], names: tuple[str, ...]
    ) -> tuple[set[str], set[str]]:
        """(nodes, values) of ``block`` that the values ``names`` depend on, transitively; a
        loop's dependencies are its ``need`` (one not among ``loops``, a region's, ends the
        search there)."""
        made_by: dict[str, ir.Node] = {}
        for n in block.nodes:
            for v in dataflow.node_outputs(n):
                made_by[v] = n
        nodes: set[str] = set()
        values: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in values:
                continue
            values.add(name)
            node = made_by.get(name)
            if node is None or node.name in nodes:
                continue
            nodes.add(node.name)
            if isinstance(node, ir.Op):
                todo += dataflow.node_inputs(node)
            elif node.name in loops:
                todo += loops[node.name].need
        return nodes, values


def simple_loop(ls: LoopSpec) -> bool:
    """A loop the runner may step by itself: a straight body of nodes, no stream in (its
    committed items may feed streams of its frame: the conductor appends them and grants it
    credit as the consumers take them)."""
    body = ls.body
    return (
        not body.loops
        and not body.regions
        and not body.streams
        and not isinstance(ls.node.trips, ir.StreamTrips)
        and not any(
            isinstance(p.role, ir.PerStep) and isinstance(p.role.source, ir.ChunkStep)
            for p in ls.node.params
        )
    )
