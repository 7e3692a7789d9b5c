"""Sections and edges: the structure a Block's dataflow implies, derived, never stored.

The IR stores blocks of nodes in SSA form; ``Sequential`` and ``Parallel`` follow from the
dataflow. ``sections(block)`` derives the tree:

1. Component ops and loops are *heavy* (they run on an engine); glue ops are light.
2. A heavy node's depth is 1 + the largest depth among its heavy ancestors, found by tracing
   its inputs back through glue; 0 when it has none.
3. Heavy nodes of equal depth cannot reach each other (one reaching another would make the
   other deeper): more than one at a depth form a ``Parallel`` (dependencies allow
   concurrency; placement decides whether it happens).
4. A glue node is placed right after the last heavy level it depends on; glue that depends on
   no heavy node comes first.
5. The result is a ``Sequential`` over the levels; a loop becomes a ``Loop`` (no stop) or a
   ``DynamicLoop`` whose body is the section tree of its body block.

The CFG example's denoising loop body (three denoiser calls, then guidance glue)::

    Sequential(Parallel(denoiser, denoiser_1, denoiser_2), sub, mul, add, ...)

The tree is a valid execution order: within a level, glue keeps its block order. Loops joined
by a streaming edge appear in sequence (the consumer depends on the producer's accumulated
channel); ``edges()`` marks that edge as streaming, which lets them overlap chunk by chunk.

``edges(walk)`` lists the walk's edges: a plain edge per (value, consuming node), with the value
metadata capture recorded, and a streaming edge per ``walk.streams`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from walkserve.capture import dataflow, ir


@dataclass(frozen=True)
class NodeRef:
    """One op of the block by name."""

    name: str
    kind: Literal["component", "glue"]


@dataclass(frozen=True)
class Sequential:
    items: tuple[Section, ...]


@dataclass(frozen=True)
class Parallel:
    """Heavy nodes (components, loops) that cannot reach each other."""

    items: tuple[Section, ...]


@dataclass(frozen=True)
class Loop:
    node_name: str
    trips: ir.TripCount
    body: Section


@dataclass(frozen=True)
class DynamicLoop:
    """A loop with a per-request stop, bounded by ``max_iters``."""

    node_name: str
    trips: ir.TripCount
    max_iters: int | str | None
    body: Section


Section = Sequential | Parallel | Loop | DynamicLoop | NodeRef


def is_heavy(node: ir.Node) -> bool:
    return isinstance(node, ir.LoopNode) or node.kind == "component"


def levels(block: ir.Block) -> dict[str, int]:
    """Node name -> level: a heavy node's depth; for glue, the largest depth of the heavy nodes
    it depends on (-1: none)."""
    producer: dict[str, str] = {}  # value -> node name
    level: dict[str, int] = {}
    for node in block.nodes:
        up = max(
            (level[producer[v]] for v in dataflow.node_inputs(node) if v in producer), default=-1
        )
        level[node.name] = up + 1 if is_heavy(node) else up
        for out in dataflow.node_outputs(node):
            producer[out] = node.name
    return level


def sections(block: ir.Block) -> Sequential:
    """The section tree of ``block`` (see the module docstring)."""
    level = levels(block)
    depth = max((level[n.name] for n in block.nodes if is_heavy(n)), default=-1)
    items: list[Section] = [NodeRef(n.name, "glue") for n in block.nodes if level[n.name] == -1]
    for d in range(depth + 1):
        heavy = [_section_of(n) for n in block.nodes if is_heavy(n) and level[n.name] == d]
        items.append(Parallel(tuple(heavy)) if len(heavy) > 1 else heavy[0])
        items += [
            NodeRef(n.name, "glue") for n in block.nodes if not is_heavy(n) and level[n.name] == d
        ]
    return Sequential(tuple(items))


def _section_of(node: ir.Node) -> Section:
    if isinstance(node, ir.Op):
        return NodeRef(node.name, node.kind)
    body = sections(node.body)
    if node.dynamic:
        return DynamicLoop(node.name, node.trips, node.max_iters, body)
    return Loop(node.name, node.trips, body)


def section_name(section: Section) -> str | None:
    """The node a leaf or loop section stands for (None for Sequential/Parallel)."""
    if isinstance(section, NodeRef):
        return section.name
    if isinstance(section, (Loop, DynamicLoop)):
        return section.node_name
    return None


def parallel_groups(block: ir.Block) -> list[list[str]]:
    """Node names of every ``Parallel`` section of ``block`` and of its loop bodies, outer
    groups before the groups inside a loop that follows them (pre-order)."""
    groups: list[list[str]] = []

    def visit(section: Section) -> None:
        if isinstance(section, Parallel):
            groups.append([name for s in section.items if (name := section_name(s)) is not None])
        if isinstance(section, (Sequential, Parallel)):
            for item in section.items:
                visit(item)
        elif isinstance(section, (Loop, DynamicLoop)):
            visit(section.body)

    visit(sections(block))
    return groups


# ---------------------------------------------------------------------------------- edges


@dataclass(frozen=True)
class Edge:
    """``value`` flows from node ``producer`` (None: a walk input or a loop body parameter) to
    node ``consumer``. A streaming edge has ``stream`` set: the consumer loop takes the value
    chunk by chunk under ``stream.policy``."""

    value: str
    producer: str | None
    consumer: str
    meta: ir.ValueMeta | None
    stream: ir.StreamEdge | None = None

    @property
    def streaming(self) -> bool:
        return self.stream is not None


def plain_inputs(node: ir.Node) -> list[str]:
    """Values a node reads in its enclosing scope, without repeats, except stream chunks
    (those arrive over the streaming edge)."""
    if isinstance(node, ir.Op):
        return list(dict.fromkeys(dataflow.node_inputs(node)))
    return list(
        dict.fromkeys(r for p in node.params for r in dataflow.role_refs(p.role, streams=False))
    )


def edges(walk: ir.Walk) -> list[Edge]:
    """Plain edges of the walk and of every loop body (block order), then streaming edges."""
    producer: dict[str, str] = {}
    for node in dataflow.iter_nodes(walk.body):
        for out in dataflow.node_outputs(node):
            producer[out] = node.name
    found = [
        Edge(v, producer.get(v), node.name, walk.values.get(v))
        for node in dataflow.iter_nodes(walk.body)
        for v in plain_inputs(node)
    ]
    found += [
        Edge(s.source, producer.get(s.source), s.consumer, walk.values.get(s.source), s)
        for s in walk.streams
    ]
    return found
