"""The regions pass: which parts of each walk one rank runs by itself.

A *region* is a run of consecutive items of one block (plan nodes, and loops whose whole body,
nested loops included, sits on the same single rank) that the runtime hands to that rank once
per request: the rank steps its loops, evaluates their stops, keeps their carried values and
reports back only at the region's exit (plus the committed items of its streamed channels).
The conductor never sees its iterations. A run whose nodes all have the same replicas is a
region of each replica (``RegionPlan.replicas``: the batcher picks one per request, where its
state lives). Everything else (loops whose bodies span ranks) the conductor drives node by
node, and the pass looks inside those loops for
regions of their own::

    walk decode (everything on rank 0)             walk generate (branches on ranks 0 and 1)
      region r0 @ rank 0: [step]                      region r0 @ rank 0: [full_like, text_encoder, ...]
        loop step x max_new_tokens                    loop euler_step        (spans ranks: driven)
                                                        denoiser    @ 0       node by node
                                                        denoiser_1  @ 1
                                                      region r1 @ rank 0: [decoder]

Rules, each keeping a region from waiting on anything its first item does not wait on (so a
region never delays work that node-by-node dispatch would have started):

- an item joins the run before it only if it is on the same rank and every value it reads from
  outside the run is a parameter of the block or already read by the run;
- a stream between two rank-local loops goes from region to region: the producer's region
  sends each committed item on (its ``forwards``), the consumer's region takes them in (its
  ``fed`` streams), ranks apart or not; a stream from a rank-local loop into one the conductor
  drives (a consumer on replicas, or whose body spans ranks) is one of the producer region's
  ``feeds``: it sends each committed item on, as far as the conductor's credit allows, and the
  conductor cuts the chunks itself; a consumer of a conductor-driven producer is
  conductor-driven too, and so is a producer on replicas with its consumer;
- a run holds at least one loop or two nodes (a lone node is dispatched as a node).

What crosses the boundary: ``regions(walk, plan_block)`` reads the IR and the placed plan (every
``NodePlan.ranks`` set) and returns ``RegionPlan`` records; the plan keeps them per walk.
"""

from __future__ import annotations

from collections.abc import Iterator

from walkserve.capture import dataflow, ir
from walkserve.capture.loopsem import bound_inputs
from walkserve.lowering.plan import BlockPlan, LoopPlan, NodePlan, RegionPlan

__all__ = ["conductor_values", "find_regions"]


def find_regions(walk: ir.Walk, block: BlockPlan) -> list[RegionPlan]:
    """The regions of ``walk`` as placed in ``block`` (its plan), outer blocks first."""
    finder = _Finder(walk)
    pinned = {r for a in walk.outputs.values() for r in dataflow.arg_refs(a)}
    finder.block(walk.body, block, [], pinned)
    return finder.found


class _Finder:
    def __init__(self, walk: ir.Walk) -> None:
        self.walk = walk
        self.found: list[RegionPlan] = []
        self.edges: list[tuple[str, str, ir.StreamEdge]] = []  # streams of rank-local loops
        self.apart: list[tuple[str, str, ir.StreamEdge]] = []  # ... between two regions
        # streams from a rank-local loop into one the conductor drives
        self.to_conductor: list[tuple[str, str, ir.StreamEdge]] = []
        nodes = dataflow.iter_nodes(walk.body)
        self.ir_nodes: dict[str, ir.Node] = {n.name: n for n in nodes}
        self.streams = {e.name: e for e in walk.streams}

    # ------------------------------------------------------------------ one block

    def block(self, body: ir.Block, plan: BlockPlan, path: list[str], pinned: set[str]) -> None:
        items = plan.nodes
        local = {item.name: self._rank(item) for item in items}
        # Streams between loops of this block: both ends must share a run, else neither is
        # rank-local. Runs depend on which loops are local, so repeat until nothing changes.
        pairs = self._stream_pairs(items)
        for producer, consumer, _ in pairs:  # replicas: no region streams to another region
            if len(local[producer] or ()) > 1:
                local[producer] = local[consumer] = None
            elif len(local[consumer] or ()) > 1:
                local[consumer] = None  # the conductor drives it; its producer may stay
        while True:  # a consumer of a conductor-driven producer: conductor-driven too
            half = {
                consumer
                for producer, consumer, _ in pairs
                if local[producer] is None and local[consumer] is not None
            }
            if not half:
                break
            for name in half:
                local[name] = None
        from_local = [(p, c, e) for p, c, e in pairs if local[p] is not None]
        self.edges = [(p, c, e) for p, c, e in from_local if local[c] is not None]
        self.to_conductor = [(p, c, e) for p, c, e in from_local if local[c] is None]
        runs = self._runs(body, items, local)
        run_of = {name: k for k, run in enumerate(runs) for name in run}
        self.apart = [(p, c, e) for p, c, e in self.edges if run_of[p] != run_of[c]]
        for run in runs:
            if len(run) > 1 or any(isinstance(self._item(items, n), LoopPlan) for n in run):
                self.found.append(self._region(body, items, run, path, pinned, local))
        for item in items:
            if isinstance(item, LoopPlan) and local[item.name] is None:
                loop = self.ir_nodes[item.name]
                assert isinstance(loop, ir.LoopNode)
                inner = {*loop.outputs, *([loop.stop] if loop.stop else [])}
                self.block(loop.body, item.body, [*path, item.name], inner)

    def _runs(
        self,
        body: ir.Block,
        items: list[NodePlan | LoopPlan],
        local: dict[str, tuple[int, ...] | None],
    ) -> list[list[str]]:
        params = set(body.params)
        runs: list[list[str]] = []
        run: list[str] = []
        rank: tuple[int, ...] | None = None
        made: set[str] = set()
        needs: set[str] = set()
        for item in items:
            r = local[item.name]
            reads = set(self._reads(item)) - made
            joins = (
                run
                and r is not None
                and r == rank
                and all(v in params or v in needs for v in reads)
            )
            if not joins:
                if run:
                    runs.append(run)
                run, made, needs, rank = [], set(), set(), r
                if r is None:
                    continue
            run.append(item.name)
            needs |= reads
            made |= set(self._makes(item))
        if run:
            runs.append(run)
        return runs

    def _region(
        self,
        body: ir.Block,
        items: list[NodePlan | LoopPlan],
        run: list[str],
        path: list[str],
        pinned: set[str],
        local: dict[str, tuple[int, ...] | None],
    ) -> RegionPlan:
        members = [self._item(items, n) for n in run]
        made: set[str] = set()
        inputs: dict[str, None] = {}
        for item in members:
            for v in self._reads(item):
                if v not in made:
                    inputs[v] = None
            made |= set(self._makes(item))
        later: set[str] = set(pinned)
        for item in items:
            if item.name not in run:
                later |= set(self._reads(item))
        if not path:
            later |= {r for a in self.walk.outputs.values() for r in dataflow.arg_refs(a)}
        outputs = [v for item in members for v in self._makes(item) if v in later]
        trips: dict[str, None] = {}
        for item in members:
            for loop in self._loops(item):
                trips.update(dict.fromkeys(bound_inputs(loop)))
        streamed = []
        if not path:  # client streams: accumulated walk outputs of the walk's own loops
            emitted = {
                a.name
                for k, a in self.walk.outputs.items()
                if isinstance(a, ir.Ref) and k not in self.walk.state
            }
            for item in members:
                node = self.ir_nodes[item.name]
                if isinstance(node, ir.LoopNode):
                    streamed += [ch for ch in node.accumulated if ch in emitted]
        fed = [e.name for _, c, e in self.apart if c in run]
        feeds = [e.name for p, _, e in self.to_conductor if p in run]
        forwards = list(
            dict.fromkeys(e.source for p, _, e in [*self.apart, *self.to_conductor] if p in run)
        )
        ranks = local[run[0]]
        assert ranks is not None
        return RegionPlan(
            name=f"{'/'.join(path) + '/' if path else ''}region{len(self.found)}",
            rank=ranks[0],
            replicas=list(ranks) if len(ranks) > 1 else [],
            path=list(path),
            items=list(run),
            inputs=[v for v in inputs if v not in trips],
            outputs=outputs,
            trip_inputs=list(trips),
            streamed=streamed,
            fed=fed,
            forwards=forwards,
            feeds=feeds,
        )

    # ------------------------------------------------------------------ items

    def _rank(self, item: NodePlan | LoopPlan) -> tuple[int, ...] | None:
        """The ranks every node of an item runs on (one rank, or the same replicas), or None
        (a body across ranks)."""
        ranks = {tuple(n.ranks) for n in _plan_nodes(item)}
        if len(ranks) != 1:
            return None
        return next(iter(ranks))

    def _reads(self, item: NodePlan | LoopPlan) -> list[str]:
        """What ``item`` needs from outside itself; a stream from a rank-local loop is not a
        read (its items come from region to region, or from the region to the conductor)."""
        if isinstance(item, NodePlan):
            inside = set(item.ops)
            out: list[str] = []
            for name in item.ops:
                node = self.ir_nodes[name]
                out += [r for r in dataflow.node_inputs(node) if r not in inside]
            return out
        node = self.ir_nodes[item.name]
        streamed = {e.source for _, c, e in [*self.edges, *self.to_conductor] if c == item.name}
        return [v for v in dataflow.node_inputs(node) if v not in streamed]

    def _makes(self, item: NodePlan | LoopPlan) -> list[str]:
        if isinstance(item, NodePlan):
            return list(item.ops)
        return dataflow.node_outputs(self.ir_nodes[item.name])

    def _loops(self, item: NodePlan | LoopPlan) -> Iterator[ir.LoopNode]:
        node = self.ir_nodes[item.name]
        if isinstance(node, ir.LoopNode):
            yield node
            for inner in dataflow.iter_nodes(node.body):
                if isinstance(inner, ir.LoopNode):
                    yield inner

    @staticmethod
    def _item(items: list[NodePlan | LoopPlan], name: str) -> NodePlan | LoopPlan:
        return next(i for i in items if i.name == name)

    def _stream_pairs(
        self, items: list[NodePlan | LoopPlan]
    ) -> list[tuple[str, str, ir.StreamEdge]]:
        """(producer loop, consumer loop, edge) of every stream between two loops of this
        block (a stream of a whole value has no producer loop: its source is an input)."""
        made_by = {
            ch: item.name
            for item in items
            if isinstance(item, LoopPlan)
            for ch in dataflow.node_outputs(self.ir_nodes[item.name])
        }
        names = {i.name for i in items}
        return [
            (made_by[e.source], e.consumer, e)
            for e in self.walk.streams
            if e.consumer in names and e.source in made_by
        ]


def _plan_nodes(item: NodePlan | LoopPlan) -> list[NodePlan]:
    if isinstance(item, NodePlan):
        return [item]
    out: list[NodePlan] = []
    for n in item.body.nodes:
        out += _plan_nodes(n)
    return out


def conductor_values(walk: ir.Walk, regions: list[RegionPlan]) -> list[str]:
    """The values of ``walk`` whose bytes must reach the conductor's process: what a client
    receives (the walk's outputs but its state) and what the conductor computes with itself
    for the loops it drives (a per-step slice's source, a stop, the pieces it accumulates or
    cuts into stream chunks). Every other value may stay on the rank that made it."""
    out: dict[str, None] = {}
    for name, arg in walk.outputs.items():
        if name not in walk.state:
            out.update(dict.fromkeys(dataflow.arg_refs(arg)))
    inside = {
        (tuple(r.path), item) for r in regions for item in r.items
    }  # (block path, item name) run by a rank
    edges = {e.name: e for e in walk.streams}

    def visit(block: ir.Block, path: tuple[str, ...]) -> None:
        for node in block.nodes:
            if not isinstance(node, ir.LoopNode) or (path, node.name) in inside:
                continue
            for p in node.params:
                role = p.role
                if isinstance(role, ir.PerStep) and isinstance(role.source, ir.SelectStep):
                    out.update(dict.fromkeys(dataflow.arg_refs(role.source.source)))
                if isinstance(role, ir.PerStep) and isinstance(role.source, ir.ChunkStep):
                    out[role.source.source] = None  # a whole value cut into chunks
            if node.stop is not None:
                out[node.stop] = None
            for acc in node.accumulated.values():
                out[node.outputs[acc.output]] = None
            for e in edges.values():
                if e.consumer == node.name:
                    out[e.source] = None
            visit(node.body, (*path, node.name))

    visit(walk.body, ())
    return list(out)
