"""Value flow of a walk: where each value goes, across loop boundaries.

Owns ``ValueFlow``, an analysis of one walk's IR: which ops read each value, and which values
a value *becomes* at a loop boundary::

    outer value  -> loop parameter      (initial, invariant or per-step source; a streamed
                                         channel -> the consumer's chunk parameter)
    body output  -> carried parameter   (the next iteration)
    body output  -> terminal / accumulated channel (the outer scope)

On top of it, ``consumers(op)`` and ``producers(op)`` find the component ops an op's value
reaches, or that reach its inputs, through glue and loop boundaries only (a component ends the
search). Placement uses them to put glue next to a component. Ops are named by the value they
produce (SSA), so an op name is also a value name.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

from walkserve.capture import dataflow, ir
from walkserve.lowering.plan import NodePlan

__all__ = ["ValueFlow", "node_io", "reader_ranks", "value_readers"]


class ValueFlow:
    """The value flow of one walk (see the module docstring). ``readers[value]``: ops reading
    it; ``becomes[value]`` / ``comes_from[value]``: the loop-boundary links; ``order[op]``: the
    op's position in the walk (``dataflow.iter_nodes`` order)."""

    def __init__(self, walk: ir.Walk) -> None:
        self.values = walk.values
        self.ops: dict[str, ir.Op] = {}
        self.order: dict[str, int] = {}
        self.readers: defaultdict[str, list[str]] = defaultdict(list)
        self.becomes: defaultdict[str, list[str]] = defaultdict(list)
        self.comes_from: defaultdict[str, list[str]] = defaultdict(list)
        for node in dataflow.iter_nodes(walk.body):
            if isinstance(node, ir.Op):
                self.order[node.name] = len(self.order)
                self.ops[node.name] = node
                for value in dataflow.node_inputs(node):
                    self.readers[value].append(node.name)
            else:
                self._add_loop(node)

    def _add_loop(self, loop: ir.LoopNode) -> None:
        for param in loop.params:
            sources = dataflow.role_refs(param.role)
            if isinstance(param.role, ir.Carried):
                sources.append(loop.outputs[param.role.output])
            for value in sources:
                self._link(value, param.name)
        for channel, index in loop.terminal.items():
            self._link(loop.outputs[index], channel)
        for channel, acc in loop.accumulated.items():
            self._link(loop.outputs[acc.output], channel)

    def _link(self, value: str, into: str) -> None:
        self.becomes[value].append(into)
        self.comes_from[into].append(value)

    def is_component(self, name: str) -> bool:
        return name in self.ops and self.ops[name].kind == "component"

    def unpacks(self, op: str) -> list[str]:
        """Component ops whose non-tensor output (a tuple, a structured value) ``op`` reads."""
        return [
            value
            for value in dataflow.node_inputs(self.ops[op])
            if self.is_component(value) and isinstance(self.values.get(value), ir.OpaqueMeta)
        ]

    def glue_readers(self, op: str) -> list[str]:
        """Glue ops reading ``op``'s value directly (same block, later in the walk)."""
        return [r for r in self.readers[op] if not self.is_component(r)]

    def consumers(self, op: str) -> list[str]:
        """Component ops that ``op``'s value reaches without passing another component."""

        def step(value: str) -> tuple[list[str], list[str]]:
            readers = self.readers[value]
            hits = [r for r in readers if self.is_component(r)]
            return hits, [r for r in readers if r not in hits] + self.becomes[value]

        return _search([op], step)

    def producers(self, op: str) -> list[str]:
        """Component ops whose values reach ``op``'s inputs without passing another component."""

        def step(value: str) -> tuple[list[str], list[str]]:
            if self.is_component(value):
                return [value], []
            if value in self.ops:
                return [], dataflow.node_inputs(self.ops[value])
            return [], self.comes_from[value]

        return _search(dataflow.node_inputs(self.ops[op]), step)


def _search(start: list[str], step: Callable[[str], tuple[list[str], list[str]]]) -> list[str]:
    """Breadth-first from ``start``: ``step(value)`` returns (hits, values to visit next)."""
    hits: list[str] = []
    seen, todo = set(start), deque(start)
    while todo:
        found, more = step(todo.popleft())
        hits += [h for h in found if h not in hits]
        for value in more:
            if value not in seen:
                seen.add(value)
                todo.append(value)
    return hits


def value_readers(walk: ir.Walk) -> dict[str, set[str]]:
    """Who reads each value of ``walk``: op names, or ``<loop NAME>``, ``<walk outputs>``,
    ``<stream>`` for the loop plumbing, the walk's results and streaming edges."""
    readers: dict[str, set[str]] = {}

    def add(names: list[str], reader: str) -> None:
        for name in names:
            readers.setdefault(name, set()).add(reader)

    def visit(block: ir.Block) -> None:
        for n in block.nodes:
            if isinstance(n, ir.Op):
                add(dataflow.node_inputs(n), n.name)
            else:
                add(
                    [*dataflow.node_inputs(n), *n.outputs, *([n.stop] if n.stop else [])],
                    f"<loop {n.name}>",
                )
                visit(n.body)

    visit(walk.body)
    add([r for a in walk.outputs.values() for r in dataflow.arg_refs(a)], "<walk outputs>")
    add([e.source for e in walk.streams], "<stream>")
    return readers


def reader_ranks(walk: ir.Walk, nodes: list[NodePlan]) -> dict[str, list[int]]:
    """The ranks that may read the bytes of each value of ``walk`` as placed in ``nodes`` (its
    plan's, ``ExecutablePlan.nodes``): the ranks of the ops that read it or anything it
    becomes at a loop boundary (a loop parameter read inside the body, a carried value's next
    iteration, a terminal channel read after the loop, a streamed channel's chunks). A value
    that reaches the walk's outputs (a client's, or the next walk's state) is not listed, nor
    one read by an op no node runs: any rank may read those."""
    op_ranks = {op: node.ranks for node in nodes for op in node.ops}
    flow = ValueFlow(walk)
    leaving = {r for a in walk.outputs.values() for r in dataflow.arg_refs(a)}
    out: dict[str, list[int]] = {}
    for value in {*flow.ops, *flow.readers, *flow.becomes}:
        reach = _search([value], lambda v: ([v], flow.becomes[v]))  # value and all it becomes
        readers = [op for v in reach for op in flow.readers[v]]
        if leaving.isdisjoint(reach) and all(op in op_ranks for op in readers):
            out[value] = sorted({r for op in readers for r in op_ranks[op]})
    return out


def node_io(
    ops: dict[str, ir.Op], names: list[str], readers: dict[str, set[str]]
) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the dispatch unit running ops ``names`` (in order): the values
    they read that they do not make, and those they make that something else reads."""
    inside = set(names)
    inputs: dict[str, None] = {}
    for name in names:
        for ref in dataflow.node_inputs(ops[name]):
            if ref not in inside:
                inputs[ref] = None
    outputs = [name for name in names if readers.get(name, set()) - inside]
    return list(inputs), outputs
