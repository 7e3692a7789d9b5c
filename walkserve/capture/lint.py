"""lint(): every structural invariant of the Walk Graph IR, checked in one pass.

``trace()`` runs it on what capture produced; every pass that rewrites the IR runs it again
(torch.fx's ``Graph.lint()`` discipline). A broken invariant raises ``LintError``, whose message
names the walk, the node and the rule; ``rule``, ``walk`` and ``node`` are attributes too.

Rules (``LintError.rule``), per graph:

    version          graph.version == ir.IR_VERSION
    graph-keys       there is a walk; walks[k].name == k; components[k].path == k
    constant         a tensor constant's dtype is a torch dtype and its bytes fill dtype x shape

per walk (one namespace for all value names of a walk, loop bodies included):

    walk-params      the walk body's params are the walk inputs, in order
    unique-name      value names (walk inputs, op names, loop channels, body params, body op
                     names) are unique within the walk; node names (ops, loops) too
    undefined-ref    a Ref names a value defined earlier in its own scope: a loop body sees only
                     its params and its earlier nodes, the walk its inputs and earlier
                     nodes/channels (so no dangling inputs, and nodes are in execution order)
    tensor-const     a TensorConst names an entry of graph.constants
    op-kind          an Op is a component or glue
    component        a component op names an entry of graph.components
    glue-target      glue targets are function:<allowlisted dotted name or registered glue
                     function> or method:<public name>
    loop-params      every body param has exactly one LoopParam and vice versa
    loop-outputs     body outputs and the stop name values of the body
    carried          Carried.output indexes a body output; each output feeds at most one carried
                     param; carried params take outputs 0..k-1 in their order
    channels         terminal and accumulated channels: disjoint, named <loop>.*, valid indices
    trips            FixedTrips count > 0; InputTrips name a walk input; ExprTrips read walk
                     inputs only; TableStep only in fixed loops, one value per iteration
    stop             a fixed loop with a stop has max_iters; max_iters is an int > 0 or a walk
                     input
    stream           StreamTrips/ChunkStep name a stream of the walk consumed by that loop, whose
                     source is defined before the loop; every stream's consumer iterates it; its
                     policy parses (chunk.ChunkPolicy.from_json)
    walk-outputs     walk outputs refer to defined values; state names outputs; next names a walk
    values-meta      walk.values names values of the walk; a carried value's init and body
                     output have the same dtype and rank where both were recorded
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NoReturn

import torch

from walkserve.capture import dataflow, ir
from walkserve.capture.chunk import ChunkPolicy
from walkserve.capture.convert import SAFE_BUILTINS, SAFE_MODULES
from walkserve.capture.gluefn import registered


class LintError(ValueError):
    """A broken IR invariant: ``rule`` (see the module docstring), where (``walk``, ``node``)."""

    def __init__(
        self, rule: str, message: str, walk: str | None = None, node: str | None = None
    ) -> None:
        self.rule = rule
        self.walk = walk
        self.node = node
        where = [f"walk {walk!r}"] if walk is not None else []
        where += [f"node {node!r}"] if node is not None else []
        prefix = ", ".join(where) + ": " if where else ""
        super().__init__(f"{prefix}{message} [lint: {rule}]")


def lint(graph: ir.WalkGraph) -> None:
    """Raise ``LintError`` at the first broken invariant of ``graph``."""
    if graph.version != ir.IR_VERSION:
        raise LintError(
            "version", f"IR version {graph.version} is not the supported {ir.IR_VERSION}"
        )
    if not graph.walks:
        raise LintError("graph-keys", "the graph has no walk")
    for key, info in graph.components.items():
        if info.path != key:
            raise LintError(
                "graph-keys", f"component key {key!r} differs from its path {info.path!r}"
            )
    for name, data in graph.constants.items():
        _check_constant(name, data)
    for key, walk in graph.walks.items():
        if walk.name != key:
            raise LintError("graph-keys", f"walk key {key!r} differs from its name", walk.name)
        _WalkLinter(graph, walk).run()


def _check_constant(name: str, data: ir.TensorData) -> None:
    dtype = getattr(torch, data.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise LintError("constant", f"tensor constant {name!r} has unknown dtype {data.dtype!r}")
    if any(d < 0 for d in data.shape):
        raise LintError("constant", f"tensor constant {name!r} has negative shape {data.shape}")
    want = dtype.itemsize * math.prod(data.shape)
    if len(data.data) != want:
        raise LintError(
            "constant",
            f"tensor constant {name!r} holds {len(data.data)} bytes, but {data.dtype}"
            f"{data.shape} needs {want}",
        )


def _sub_args(arg: ir.Arg) -> Iterator[ir.Arg]:
    """``arg`` and every argument nested in it."""
    yield arg
    items: list[ir.Arg] = []
    if isinstance(arg, (ir.ListArg, ir.TupleArg)):
        items = arg.items
    elif isinstance(arg, ir.DictArg):
        items = list(arg.items.values())
    elif isinstance(arg, ir.SliceArg):
        items = [arg.start, arg.stop, arg.step]
    for item in items:
        yield from _sub_args(item)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _WalkLinter:
    """Checks one walk. ``defined`` collects every value name of the walk (all scopes)."""

    def __init__(self, graph: ir.WalkGraph, walk: ir.Walk) -> None:
        self.graph = graph
        self.walk = walk
        self.inputs = [i.name for i in walk.inputs]
        self.defined: set[str] = set()
        self.node_names: set[str] = set()
        self.streams: dict[str, ir.StreamEdge] = {}
        nodes = dataflow.iter_nodes(walk.body)
        self.loops = {n.name: n for n in nodes if isinstance(n, ir.LoopNode)}
        # Every name anything defines, to tell a dangling reference from one out of order.
        self.all_values = set(self.inputs)
        for n in nodes:
            self.all_values.update(dataflow.node_outputs(n))
            if isinstance(n, ir.LoopNode):
                self.all_values.update(n.body.params)

    def fail(self, rule: str, message: str, node: str | None = None) -> NoReturn:
        raise LintError(rule, message, self.walk.name, node)

    def run(self) -> None:
        w = self.walk
        if w.body.params != self.inputs:
            self.fail(
                "walk-params",
                f"body params {w.body.params} are not the walk inputs {self.inputs}",
            )
        for name in self.inputs:
            self.define(name, None)
        self.check_streams()
        scope = set(self.inputs)
        self.block(w.body, scope)
        for key, arg in w.outputs.items():
            self.arg(arg, scope, None, f"output {key!r}")
        for s in w.state:
            if s not in w.outputs:
                self.fail("walk-outputs", f"state {s!r} is not an output of the walk")
        if w.next is not None and w.next not in self.graph.walks:
            self.fail("walk-outputs", f"next names {w.next!r}, which is not a walk of the graph")
        unknown = sorted(set(w.values) - self.defined)
        if unknown:
            self.fail("values-meta", f"values records {unknown}, which are not values of the walk")

    # ------------------------------------------------------------------ names and arguments

    def define(self, name: str, node: str | None) -> None:
        if name in self.defined:
            self.fail("unique-name", f"value name {name!r} is defined twice", node)
        self.defined.add(name)

    def ref(self, name: str, scope: set[str], node: str | None, what: str) -> None:
        if name in scope:
            return
        if name not in self.all_values:
            self.fail("undefined-ref", f"{what} refers to {name!r}, which nothing defines", node)
        self.fail(
            "undefined-ref",
            f"{what} refers to {name!r}, which is not defined earlier in the same scope "
            "(nodes out of execution order, or a value of another loop body or the walk)",
            node,
        )

    def arg(self, arg: ir.Arg, scope: set[str], node: str | None, what: str) -> None:
        for sub in _sub_args(arg):
            if isinstance(sub, ir.Ref):
                self.ref(sub.name, scope, node, what)
            elif isinstance(sub, ir.TensorConst) and sub.name not in self.graph.constants:
                self.fail(
                    "tensor-const",
                    f"{what} uses tensor constant {sub.name!r}, which graph.constants lacks",
                    node,
                )

    # ------------------------------------------------------------------ blocks and ops

    def block(self, block: ir.Block, scope: set[str]) -> None:
        for node in block.nodes:
            if node.name in self.node_names:
                self.fail("unique-name", "node name is used twice", node.name)
            self.node_names.add(node.name)
            if isinstance(node, ir.Op):
                self.op(node, scope)
            else:
                self.loop(node, scope)

    def op(self, node: ir.Op, scope: set[str]) -> None:
        if node.kind == "component":
            if node.target not in self.graph.components:
                self.fail(
                    "component",
                    f"component {node.target!r} is not in graph.components",
                    node.name,
                )
        elif node.kind == "glue":
            problem = _glue_target_problem(node.target)
            if problem:
                self.fail("glue-target", f"glue target {node.target!r} {problem}", node.name)
        else:
            self.fail("op-kind", f"kind {node.kind!r} is neither component nor glue", node.name)
        for i, a in enumerate(node.args):
            self.arg(a, scope, node.name, f"argument {i}")
        for k, a in node.kwargs.items():
            self.arg(a, scope, node.name, f"keyword argument {k!r}")
        self.define(node.name, node.name)
        scope.add(node.name)

    # ------------------------------------------------------------------ loops

    def loop(self, node: ir.LoopNode, outer: set[str]) -> None:
        name = node.name
        self.loop_inputs(node, outer)
        self.trips(node, outer)
        param_names = [p.name for p in node.params]
        if sorted(param_names) != sorted(node.body.params) or len(set(param_names)) != len(
            param_names
        ):
            self.fail(
                "loop-params",
                f"body params {node.body.params} and loop params {param_names} must match one "
                "to one",
                name,
            )
        body_scope: set[str] = set()
        for p in node.body.params:
            self.define(p, name)
            body_scope.add(p)
        self.block(node.body, body_scope)
        for j, out in enumerate(node.outputs):
            if out not in body_scope:
                self.fail("loop-outputs", f"body output {j} names {out!r}, not a body value", name)
        if node.stop is not None and node.stop not in body_scope:
            self.fail("loop-outputs", f"stop names {node.stop!r}, not a body value", name)
        self.carried(node)
        self.channels(node)
        for ch in node.channels():
            self.define(ch, name)
            outer.add(ch)

    def loop_inputs(self, node: ir.LoopNode, outer: set[str]) -> None:
        """The outer values a loop reads: initial, invariant and per-step sources."""
        for p in node.params:
            what = f"parameter {p.name!r}"
            role = p.role
            if isinstance(role, ir.Carried):
                self.arg(role.init, outer, node.name, f"the initial value of {what}")
            elif isinstance(role, ir.Invariant):
                self.arg(role.value, outer, node.name, what)
            elif isinstance(role.source, ir.SelectStep):
                self.arg(role.source.source, outer, node.name, what)
            elif isinstance(role.source, ir.TableStep):
                table = role.source.values
                if not isinstance(node.trips, ir.FixedTrips) or node.dynamic:
                    self.fail("trips", f"{what} is a table, allowed in fixed loops only", node.name)
                if len(table) < node.trips.count:
                    self.fail(
                        "trips",
                        f"{what} has {len(table)} table values for {node.trips.count} iterations",
                        node.name,
                    )
                for v in table:
                    self.arg(v, outer, node.name, what)
            elif isinstance(role.source, ir.ChunkStep):
                step = role.source
                edge = self.stream_of_loop(step.stream, node, outer, what)
                if node.trips != ir.StreamTrips(step.stream):
                    self.fail(
                        "stream",
                        f"{what} takes chunks of {step.stream!r}, but the loop's trips are "
                        f"{node.trips}",
                        node.name,
                    )
                if step.source != edge.source:
                    self.fail(
                        "stream",
                        f"{what} names source {step.source!r}, but stream {edge.name!r} carries "
                        f"{edge.source!r}",
                        node.name,
                    )

    def trips(self, node: ir.LoopNode, outer: set[str]) -> None:
        trips = node.trips
        if isinstance(trips, ir.FixedTrips) and not _is_positive_int(trips.count):
            self.fail(
                "trips", f"a fixed trip count must be an int > 0, got {trips.count!r}", node.name
            )
        if isinstance(trips, ir.InputTrips) and trips.input not in self.inputs:
            self.fail("trips", f"trip count input {trips.input!r} is not a walk input", node.name)
        if isinstance(trips, ir.ExprTrips):
            unknown = [i for i in dataflow.expr_inputs(trips.expr) if i not in self.inputs]
            if unknown:
                self.fail(
                    "trips", f"the trip count reads {unknown}, which are not walk inputs", node.name
                )
        if isinstance(trips, ir.StreamTrips):
            self.stream_of_loop(trips.stream, node, outer, "the trip count")
        if node.stop is not None and node.max_iters is None and isinstance(trips, ir.FixedTrips):
            # A loop over a stream is bounded by the stream's chunks, one over an input or an
            # expression by its value.
            self.fail("stop", "a loop with a stop (a DynamicLoop) needs max_iters", node.name)
        m = node.max_iters
        if m is not None and not (_is_positive_int(m) or (isinstance(m, str) and m in self.inputs)):
            self.fail(
                "stop", f"max_iters must be an int > 0 or a walk input's name, got {m!r}", node.name
            )

    def carried(self, node: ir.LoopNode) -> None:
        seen: dict[int, str] = {}
        for rank, p in enumerate(q for q in node.params if isinstance(q.role, ir.Carried)):
            assert isinstance(p.role, ir.Carried)
            j = p.role.output
            if not 0 <= j < len(node.outputs):
                self.fail(
                    "carried",
                    f"carried parameter {p.name!r} receives body output {j}, but the body has "
                    f"{len(node.outputs)} outputs",
                    node.name,
                )
            if j in seen:
                self.fail(
                    "carried",
                    f"body output {j} feeds two carried parameters, {seen[j]!r} and {p.name!r}",
                    node.name,
                )
            seen[j] = p.name
            if j != rank:
                self.fail(
                    "carried",
                    f"carried parameter {p.name!r} receives body output {j}; carried values are "
                    f"outputs 0..k-1 in the order of their parameters (expected {rank})",
                    node.name,
                )
            self.carried_meta(node, p.name, p.role.init, node.outputs[j])

    def carried_meta(self, node: ir.LoopNode, param: str, init: ir.Arg, out: str) -> None:
        values = self.walk.values
        a = values.get(init.name) if isinstance(init, ir.Ref) else None
        b = values.get(out)
        if a is None or b is None:
            return
        tensors = isinstance(a, ir.TensorMeta), isinstance(b, ir.TensorMeta)
        scalars = isinstance(a, ir.ScalarMeta), isinstance(b, ir.ScalarMeta)
        if (
            isinstance(a, ir.TensorMeta)
            and isinstance(b, ir.TensorMeta)
            and (a.dtype != b.dtype or len(a.shape) != len(b.shape))
        ) or (any(tensors) and any(scalars)):
            self.fail(
                "values-meta",
                f"carried value {param!r} starts as {_describe(a)} but the body returns "
                f"{_describe(b)} ({out!r})",
                node.name,
            )

    def channels(self, node: ir.LoopNode) -> None:
        both = sorted(set(node.terminal) & set(node.accumulated))
        if both:
            self.fail("channels", f"channels {both} are both terminal and accumulated", node.name)
        n = len(node.outputs)
        for ch in node.channels():
            if not ch.startswith(node.name + ".") or ch == node.name + ".":
                self.fail("channels", f"channel {ch!r} is not named {node.name}.<label>", node.name)
        for ch, j in node.terminal.items():
            if not 0 <= j < n:
                self.fail("channels", f"terminal {ch!r} reads output {j} of {n}", node.name)
        for ch, acc in node.accumulated.items():
            if not 0 <= acc.output < n:
                self.fail(
                    "channels", f"accumulated {ch!r} reads output {acc.output} of {n}", node.name
                )
            if acc.mode not in ("cat", "stack"):
                self.fail("channels", f"accumulated {ch!r} has mode {acc.mode!r}", node.name)

    # ------------------------------------------------------------------ streams

    def check_streams(self) -> None:
        for s in self.walk.streams:
            if s.name in self.streams:
                self.fail("stream", f"stream {s.name!r} is declared twice")
            self.streams[s.name] = s
            try:
                ChunkPolicy.from_json(dict(s.policy))
            except (ValueError, TypeError) as e:
                self.fail("stream", f"stream {s.name!r} has a bad policy {s.policy}: {e}")
            consumer = self.loops.get(s.consumer)
            if consumer is None:
                self.fail("stream", f"stream {s.name!r} flows to {s.consumer!r}, not a loop")
            if consumer.trips != ir.StreamTrips(s.name):
                self.fail(
                    "stream",
                    f"stream {s.name!r} flows to this loop, whose trips are {consumer.trips}",
                    s.consumer,
                )

    def stream_of_loop(
        self, stream: str, node: ir.LoopNode, outer: set[str], what: str
    ) -> ir.StreamEdge:
        edge = self.streams.get(stream)
        if edge is None:
            self.fail(
                "stream", f"{what} names stream {stream!r}, not a stream of the walk", node.name
            )
        if edge.consumer != node.name:
            self.fail(
                "stream",
                f"{what} names stream {stream!r}, which flows to {edge.consumer!r}",
                node.name,
            )
        self.ref(edge.source, outer, node.name, f"the source of stream {stream!r}")
        return edge


def _glue_target_problem(target: str) -> str | None:
    """Why ``target`` is not a valid glue target, or None."""
    kind, sep, name = target.partition(":")
    if not sep or kind not in ("function", "method") or not name:
        return "is not function:<name> or method:<name>"
    if kind == "method":
        if not name.isidentifier() or name.startswith("_"):
            return "must name a public method"
        return None
    parts = name.split(".")
    if len(parts) < 2 or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return "must be a dotted module.name without dunder parts"
    if parts[0] == "builtins":
        return (
            None if len(parts) == 2 and parts[1] in SAFE_BUILTINS else "is not an allowed builtin"
        )
    if parts[0] not in SAFE_MODULES and registered(name) is None:
        return (
            f"is outside the allowed modules {SAFE_MODULES} and not a registered glue function "
            "(capture.gluefn.glue_function)"
        )
    return None


def _describe(meta: ir.ValueMeta) -> str:
    if isinstance(meta, ir.TensorMeta):
        return f"a {meta.dtype} tensor of rank {len(meta.shape)}"
    if isinstance(meta, ir.ScalarMeta):
        return f"a Python {meta.kind}"
    return meta.kind
