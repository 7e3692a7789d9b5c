"""Loop finalization: turn the iterations a tracer recorded into one loop node.

Input: a ``LoopRecord`` (body graph traced once, one ``Iteration`` per call, stop checks).
Output: the enclosing graph rewritten so that one ``_loop_node`` (reading the outer values the
loop needs) and ``_loop_channel`` nodes replace every iteration, and a ``Finalized`` plan that
``convert`` turns into an ``ir.LoopNode``. The rules:

    argument of iteration i+1 is output j of iteration i, for every i  -> carried (output j)
    argument is the same value in every iteration                      -> invariant
    argument changes: ints affine in i / x[k] / x[:, k] / stream chunk -> per-step
    torch.cat/stack over every iteration's output j                    -> accumulated channel
    any use of the last iteration's output j                           -> terminal channel
    any other use of an earlier iteration's value                      -> capture error

``loopparams`` decides the first three rules (each body parameter's role, a ``ParamPlan``);
this module finds the channels and the stop and rewrites the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx

from walkserve.capture import ir
from walkserve.capture.errors import CaptureError
from walkserve.capture.loopparams import ParamPlan, classify
from walkserve.capture.records import (
    LoopRecord,
    Scope,
    _loop_channel,
    _loop_iter,
    _loop_node,
    _stream_chunk,
    _stream_context,
)
from walkserve.capture.tracer import WalkTracer, _nodes_in

JOINS: dict[Any, Literal["cat", "stack"]] = {
    torch.cat: "cat",
    torch.concat: "cat",
    torch.concatenate: "cat",
    torch.stack: "stack",
}


@dataclass
class Finalized:
    record: LoopRecord
    node: fx.Node  # the _loop_node in the enclosing graph
    params: list[ParamPlan]
    terminal: dict[str, int]
    accumulated: dict[str, ir.Accumulated]
    stop_output: int | None  # index of the stop value among the body graph's outputs
    trips: Literal["fixed", "input", "stream"]
    trip_count: int | str | ir.IntExpr  # input: a walk input's name or an expression
    stream_dep: int | None  # deps index of the stream source
    # nodes of the enclosing graph this loop's channels replaced (its last iteration's
    # outputs, a join of its pieces) -> the channel that stands for each now
    replaced: dict[fx.Node, fx.Node] = field(default_factory=dict)


def finalize_scope(tracer: WalkTracer, scope: Scope) -> None:
    """Finalize every loop recorded in ``scope``, in the order they started."""
    for record in scope.loops:
        if record.finalized is None:
            _check_components_used(scope.graph)
            record.finalized = _finalize(tracer, scope.graph, record)
            _rebind(scope.loops, record.finalized.replaced)
    _check_components_used(scope.graph)
    _dead_glue(scope.graph)
    leftovers = [
        n for n in scope.graph.nodes if n.target in (_stream_chunk, _stream_context, _loop_iter)
    ]
    if leftovers:
        raise CaptureError(
            "stream-consumer",
            "a stream chunk is used outside a @loop body; iterate a stream only to call a loop body",
            leftovers[0].meta.get("source"),
        )


def _rebind(records: list[LoopRecord], replaced: dict[fx.Node, fx.Node]) -> None:
    """Point the arguments that later loops' calls recorded at the channels that replaced
    them: a loop output passed straight to another loop's body (its last state, its stacked
    pieces) is the first loop's channel once that loop is one node."""
    if not replaced:
        return

    def swap(value: Any) -> Any:
        if isinstance(value, fx.Proxy) and value.node in replaced:
            value.node = replaced[value.node]
        elif isinstance(value, (list, tuple)):
            for v in value:
                swap(v)
        return value

    for record in records:
        if record.finalized is None:
            for it in record.iterations:
                for value in it.args:
                    swap(value)


def _finalize(tracer: WalkTracer, graph: fx.Graph, record: LoopRecord) -> Finalized:
    its = record.iterations
    first = its[0]
    dynamic = bool(record.checks)
    bounded_by_count = not dynamic and record.stream is None and record.trip is None
    deps: list[Any] = []

    def dep(value: Any) -> int:
        deps.append(value)
        return len(deps) - 1

    params: list[ParamPlan] = []
    carried: list[tuple[int, int]] = []  # (param position, output index)
    for pos, pname in enumerate(record.params):
        if pname in record.static:
            continue
        values = [it.args[pos] for it in its]
        plan = classify(record, pname, values, its, bounded_by_count, dep)
        if plan.role == "carried":
            carried.append((pos, plan.output))
        params.append(plan)
    for rank, (pos, out) in enumerate(carried):
        if out != rank:
            pname = record.params[pos]
            raise CaptureError(
                "carried-order",
                f"carried values returned in the wrong order: parameter '{pname}' of loop body "
                f"{record.name} receives output {out} of the previous iteration; a loop body "
                "returns its carried values first, in the order of the parameters that receive "
                f"them (expected output {rank})",
                record.source,
            )

    preds = _predicate_cones(record)
    pred_nodes = {n for cone in preds for n in cone}
    accumulated, acc_nodes = _accumulations(record, dynamic)
    _check_intermediate_uses(
        record, {p.output for p in params if p.role == "carried"}, pred_nodes, acc_nodes
    )

    stop_output = None
    if dynamic:
        stop_output = _move_predicate(record, preds[0], params, dep)

    trips: Literal["fixed", "input", "stream"]
    count: int | str | ir.IntExpr
    if record.stream is not None:
        trips, count = "stream", record.stream.key
    elif record.trip is not None:
        trips, count = "input", record.trip
    elif dynamic:
        max_iters = record.spec.max_iters
        assert max_iters is not None  # checked by the tracer at the first stop check
        trips, count = ("input", max_iters) if isinstance(max_iters, str) else ("fixed", max_iters)
    else:
        trips, count = "fixed", len(its)

    if record.stream is not None:
        stream_dep = next((p.dep for p in params if p.role in ("chunk", "context")), None)
        if stream_dep is None:
            raise CaptureError(
                "stream-consumer",
                f"loop body {record.name} is called while iterating a stream but takes no chunk",
                record.source,
            )
    else:
        stream_dep = None

    # Rewrite the enclosing graph: one loop node and its channels replace the iterations.
    last = its[-1]
    with graph.inserting_before(first.node):
        dep_args = [_as_fx_arg(tracer, d) for d in deps]
        loop_fx = graph.call_function(_loop_node, (record.key, dep_args))
        loop_fx.meta["source"] = record.source
        loop_fx.meta["seq"] = first.node.meta["seq"]
    terminal: dict[str, int] = {}
    channels: dict[str, fx.Node] = {}

    def channel(name: str) -> fx.Node:
        if name not in channels:
            with graph.inserting_after(loop_fx):
                node = graph.call_function(_loop_channel, (loop_fx, name))
            node.meta["seq"] = loop_fx.meta["seq"]
            channels[name] = node
        return channels[name]

    labels = _output_labels(record, params)
    replaced: dict[fx.Node, fx.Node] = {}
    for j, out_node in enumerate(last.outputs):
        uses = [u for u in out_node.users if u not in pred_nodes and u not in acc_nodes]
        if uses:
            name = f"{record.name}.{labels[j]}"
            terminal[name] = j
            keep = set(uses)
            out_node.replace_all_uses_with(channel(name), delete_user_cb=keep.__contains__)
            replaced[out_node] = channel(name)  # later loops' recorded calls still name it
    acc_channels: dict[str, ir.Accumulated] = {}
    for join, (j, mode, dim, run) in accumulated.items():
        name = f"{record.name}.{labels[j]}.all"
        acc_channels[name] = ir.Accumulated(j, mode, dim)
        seq = _join_seq(join)
        new_seq = [*seq[: run[0]], channel(name), *seq[run[1] :]]
        if len(new_seq) == 1:
            join.replace_all_uses_with(channel(name))
            replaced[join] = channel(name)
        else:
            _set_join_seq(join, new_seq)
    return Finalized(
        record,
        loop_fx,
        params,
        terminal,
        acc_channels,
        stop_output,
        trips,
        count,
        stream_dep,
        replaced,
    )


def _output_labels(record: LoopRecord, params: list[ParamPlan]) -> list[str]:
    labels = [f"out{j}" for j in range(record.n_outputs)]
    for p in params:
        if p.role == "carried":
            labels[p.output] = p.name
    return labels


def _predicate_cones(record: LoopRecord) -> list[list[fx.Node]]:
    """For each stop check: the glue nodes computing it from that iteration's outputs."""
    cones = []
    for i, pred in enumerate(record.checks):
        outputs = set(record.iterations[i].outputs)
        start = record.iterations[i].node.meta["seq"]
        cone: list[fx.Node] = []
        seen: set[fx.Node] = set()
        stack = [pred]
        while stack:
            n = stack.pop()
            if n in seen or n in outputs or n.meta.get("seq", -1) < start or n.op == "get_attr":
                continue
            seen.add(n)
            if n.op != "call_function" and n.op != "call_method":
                raise CaptureError(
                    "stop-predicate",
                    "the stop check of a loop must be glue on the body's outputs",
                    n.meta.get("source"),
                )
            cone.append(n)
            stack.extend(_nodes_in((n.args, n.kwargs)))
        cones.append(sorted(cone, key=lambda n: n.meta["seq"]))
    return cones


def _accumulations(
    record: LoopRecord, dynamic: bool
) -> tuple[dict[fx.Node, tuple[int, Literal["cat", "stack"], int, tuple[int, int]]], set[fx.Node]]:
    """cat/stack nodes joining every iteration's output j: join -> (j, mode, dim, run)."""
    found: dict[fx.Node, tuple[int, Literal["cat", "stack"], int, tuple[int, int]]] = {}
    its = record.iterations
    for j in range(record.n_outputs):
        per_iter = [it.outputs[j] for it in its]
        joins = {
            u
            for out in per_iter
            for u in out.users
            if u.op == "call_function" and u.target in JOINS
        }
        for join in joins:
            seq = _join_seq(join)
            hits = [k for k, item in enumerate(seq) if item in per_iter]
            run = (hits[0], hits[-1] + 1)
            if seq[run[0] : run[1]] != per_iter:
                missing = len(per_iter) - len(hits)
                hint = (
                    " (append each value before the stop check, so the stopping iteration's value is kept)"
                    if dynamic and missing == 1 and seq[run[0] : run[1]] == per_iter[:-1]
                    else ""
                )
                raise CaptureError(
                    "accumulate",
                    f"torch.{JOINS[join.target]} after loop {record.name} must join the output of "
                    f"every iteration in order{hint}",
                    join.meta.get("source"),
                )
            mode = JOINS[join.target]
            if mode == "stack" and len(seq) != len(per_iter):
                raise CaptureError(
                    "accumulate",
                    "torch.stack of loop outputs cannot hold other values",
                    join.meta.get("source"),
                )
            found[join] = (j, mode, _join_dim(join), run)
    return found, set(found)


def _join_seq(join: fx.Node) -> list[Any]:
    seq = join.args[0] if join.args else join.kwargs.get("tensors")
    return list(seq)  # type: ignore[arg-type]


def _set_join_seq(join: fx.Node, seq: list[Any]) -> None:
    if join.args:
        join.args = (seq, *join.args[1:])
    else:
        join.kwargs = {**join.kwargs, "tensors": seq}


def _join_dim(join: fx.Node) -> int:
    dim = join.args[1] if len(join.args) > 1 else join.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        raise CaptureError(
            "accumulate",
            "the dim of a cat/stack of loop outputs must be a Python int",
            join.meta.get("source"),
        )
    return dim


def _check_intermediate_uses(
    record: LoopRecord, carried_outputs: set[int], pred_nodes: set[fx.Node], acc_nodes: set[fx.Node]
) -> None:
    its = record.iterations
    for i, it in enumerate(its[:-1]):
        nxt = its[i + 1].node
        for j, out in enumerate(it.outputs):
            for user in out.users:
                if (
                    user in pred_nodes
                    or user in acc_nodes
                    or (user is nxt and j in carried_outputs)
                ):
                    continue
                raise CaptureError(
                    "loop-value-escapes",
                    f"a value of iteration {i} of loop {record.name} (output {j}) is used outside "
                    "the loop; after a loop only the last iteration's values (terminal) or every "
                    "iteration's values joined with torch.cat/stack (accumulated) can be used",
                    user.meta.get("source"),
                )


def _move_predicate(
    record: LoopRecord, cone: list[fx.Node], params: list[ParamPlan], dep: Any
) -> int:
    """Copy the first stop check's glue into the body; returns the stop's output index."""
    body = record.body
    out_node = next(n for n in body.nodes if n.op == "output")
    body_outs = list(out_node.args[0])  # type: ignore[arg-type]
    outputs = record.iterations[0].outputs
    mapping: dict[fx.Node, Any] = {o: body_outs[j] for j, o in enumerate(outputs)}
    last_ph = [n for n in body.nodes if n.op == "placeholder"]
    cone_set = set(cone)

    def lift(n: fx.Node) -> Any:
        if n in mapping:
            return mapping[n]
        if n in cone_set:
            raise AssertionError("cone nodes are copied in order")
        if n.op == "get_attr":
            with body.inserting_before(out_node):
                copy = body.get_attr(str(n.target))
            copy.meta.update(n.meta)
            mapping[n] = copy
            return copy
        anchor = last_ph[-1] if last_ph else None
        ctx = (
            body.inserting_after(anchor) if anchor is not None else body.inserting_before(out_node)
        )
        with ctx:
            ph = body.placeholder(f"stop_{n.name}")
        last_ph.append(ph)
        params.append(ParamPlan(str(ph.target), "invariant", dep(n)))
        mapping[n] = ph
        return ph

    for n in cone:
        with body.inserting_before(out_node):
            copy = body.node_copy(n, lambda a: mapping[a] if a in cone_set else lift(a))
        copy.meta.update(n.meta)
        mapping[n] = copy
    stop = mapping[record.checks[0]]
    out_node.args = ((*body_outs, stop),)
    return len(body_outs)


def _as_fx_arg(tracer: WalkTracer, value: Any) -> Any:
    """A recorded value as an fx argument of the enclosing graph (inserting point set)."""
    if isinstance(value, fx.Proxy):
        return value.node
    if isinstance(value, fx.Node):
        return value
    return tracer.create_arg(value)


def _check_components_used(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_module" and not node.users:
            raise CaptureError(
                "unused-component",
                f"the output of component '{node.target}' is never used; remove the call or use its result",
                node.meta.get("source"),
            )


def _dead_glue(graph: fx.Graph) -> None:
    """Remove glue (and loop markers) whose value nothing uses."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method", "get_attr"):
            continue
        if node.target is _loop_node:
            continue
        graph.erase_node(node)
