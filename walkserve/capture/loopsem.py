"""Loop semantics shared by every executor of the IR (the reference interpreter, the batched
runner, the runtime's conductor): how many iterations a loop may run (its trip count, an
integer expression of walk inputs evaluated per request, capped by ``max_iters``), what a
per-step parameter is in iteration ``i``, how a stream is cut into chunks, which channels a
finished loop defines, and which walk outputs stream to a client as a loop commits. One
definition, so the executors cannot drift apart."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from walkserve.capture import dataflow, ir
from walkserve.capture.chunk import ChunkPolicy, ChunkSpan, split

Chunks = list[tuple[torch.Tensor, ChunkSpan]]


class LoopError(RuntimeError):
    """A loop cannot run or finish: a bad bound, an empty accumulated channel."""


class Steps:
    """Consecutive pieces of an accumulated channel held as one tensor, steps first
    (``block[k]`` is the piece of the k-th of them): what a batch of runs that stepped together
    leaves each run, one view instead of one tensor per step. ``loop_channels`` joins it as it
    joins the pieces it stands for. Its block is the run's own (a view of rows no one else
    reads or writes), so a channel that is one ``Steps`` may be a view of it."""

    __slots__ = ("block",)

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block  # [steps, *piece]


def _joined(pieces: list[Any], mode: str, dim: int) -> torch.Tensor:
    """``torch.cat`` (``mode`` "cat") or ``torch.stack`` of ``pieces`` along ``dim``, where a
    piece may be a ``Steps`` standing for several."""
    join = torch.cat if mode == "cat" else torch.stack
    if not any(isinstance(p, Steps) for p in pieces):
        return join(pieces, dim=dim)
    parts: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []  # consecutive pieces: joined by one op, not one op each

    def flush() -> None:
        if plain:
            parts.append(join(plain, dim=dim))
            plain.clear()

    for p in pieces:
        if not isinstance(p, Steps):
            plain.append(p)
            continue
        flush()
        ndim = p.block.dim() - 1  # a piece's
        if mode == "cat":  # [steps, .., n at d, ..] -> [.., steps * n at d, ..]
            d = dim % ndim
            parts.append(p.block.movedim(0, d).flatten(d, d + 1))
        else:  # stacked at d: the steps axis moved there
            parts.append(p.block.movedim(0, dim % (ndim + 1)))
    flush()
    if len(parts) == 1:  # one join (new), or one Steps: a view of the run's own block, laid
        return parts[0].contiguous()  # out as the channel is where the cohort stacked it so
    return torch.cat(parts, dim=dim)


def int_input(inputs: Mapping[str, Any], name: str) -> int:
    """A walk input used as a loop bound: a Python int or a one-element tensor."""
    value = inputs.get(name)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value.item())
    if not isinstance(value, int) or isinstance(value, bool):
        raise LoopError(f"walk input {name!r} must be an int (a loop bound), got {value!r}")
    return value


def eval_int(expr: ir.IntExpr, inputs: Mapping[str, Any]) -> int:
    """The value of an integer trip-count expression for one request's walk inputs."""
    if isinstance(expr, ir.IntLit):
        return expr.value
    if isinstance(expr, ir.IntInput):
        return int_input(inputs, expr.name)
    if isinstance(expr, ir.IntSize):
        value = inputs.get(expr.input)
        if not isinstance(value, torch.Tensor) or not -value.dim() <= expr.dim < value.dim():
            raise LoopError(
                f"walk input {expr.input!r} must be a tensor with a dimension {expr.dim} "
                f"(a loop bound reads its size), got {_describe(value)}"
            )
        return int(value.shape[expr.dim])
    a, b = eval_int(expr.left, inputs), eval_int(expr.right, inputs)
    if expr.op in ("floordiv", "mod") and b == 0:
        raise LoopError(f"a loop bound divides by zero: {format_int(expr)} with {expr.right} = 0")
    return _BINOPS[expr.op](a, b)


_BINOPS = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
}
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//", "mod": "%"}
_PRECEDENCE = {"add": 1, "sub": 1, "mul": 2, "floordiv": 2, "mod": 2}


def format_int(expr: ir.IntExpr, outer: int = 0) -> str:
    """An integer expression as Python text: ``points - 1``, ``2 * n``, ``x.shape[1] // 4``."""
    if isinstance(expr, ir.IntLit):
        return str(expr.value)
    if isinstance(expr, ir.IntInput):
        return expr.name
    if isinstance(expr, ir.IntSize):
        return f"{expr.input}.shape[{expr.dim}]"
    level = _PRECEDENCE[expr.op]
    # Left-associative: a right operand of the same precedence needs parentheses.
    text = f"{format_int(expr.left, level)} {_SYMBOLS[expr.op]} {format_int(expr.right, level + 1)}"
    return f"({text})" if level < outer else text


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return repr(value)


def stream_edge(walk: ir.Walk, name: str) -> ir.StreamEdge:
    for edge in walk.streams:
        if edge.name == name:
            return edge
    raise LoopError(f"walk {walk.name!r} has no stream {name!r}")


def stream_chunks(walk: ir.Walk, node: ir.LoopNode, env: Mapping[str, Any]) -> Chunks | None:
    """The chunks of the complete stream a loop iterates (None if it iterates none)."""
    if not isinstance(node.trips, ir.StreamTrips):
        return None
    edge = stream_edge(walk, node.trips.stream)
    source = env[edge.source]
    dim = edge.dim if edge.dim >= 0 else source.dim() + edge.dim
    return split(source, ChunkPolicy.from_json(dict(edge.policy)), dim)


def loop_bound(node: ir.LoopNode, inputs: Mapping[str, Any], n_chunks: int | None) -> int:
    """Most iterations the loop may run: its trip count, capped by ``max_iters``."""
    trips = node.trips
    if isinstance(trips, ir.FixedTrips):
        return trips.count
    if isinstance(trips, ir.InputTrips):
        count = int_input(inputs, trips.input)
    elif isinstance(trips, ir.ExprTrips):
        count = eval_int(trips.expr, inputs)
    else:
        if n_chunks is None:
            raise LoopError(f"loop {node.name} iterates a stream but no chunks were given")
        count = n_chunks
    if node.max_iters is not None:
        cap = (
            node.max_iters if isinstance(node.max_iters, int) else int_input(inputs, node.max_iters)
        )
        count = min(count, cap)
    if count < 0:
        raise LoopError(f"loop {node.name} would run {count} iterations; a trip count is >= 0")
    return count


def bound_inputs(node: ir.LoopNode) -> list[str]:
    """The walk inputs ``loop_bound`` reads for this loop: its trip count's (an input, or
    those of an expression) and its ``max_iters`` input."""
    names: list[str] = []
    if isinstance(node.trips, ir.InputTrips):
        names.append(node.trips.input)
    elif isinstance(node.trips, ir.ExprTrips):
        names += dataflow.expr_inputs(node.trips.expr)
    if isinstance(node.max_iters, str):
        names.append(node.max_iters)
    return list(dict.fromkeys(names))


def needs_iteration(node: ir.LoopNode) -> bool:
    """Whether the loop must run at least once for its channels to have values: it has an
    accumulated channel, or a terminal one with no carried initial value (``loop_channels``)."""
    carried = {p.role.output for p in node.params if isinstance(p.role, ir.Carried)}
    return bool(node.accumulated) or any(j not in carried for j in node.terminal.values())


def step_value(
    role: ir.PerStep, i: int, value: Callable[[ir.Arg], Any], chunks: Chunks | None
) -> Any:
    """The value of a per-step parameter in iteration ``i``; ``value`` resolves outer args."""
    src = role.source
    if isinstance(src, ir.AffineStep):
        return src.start + i * src.step
    if isinstance(src, ir.TableStep):
        return value(src.values[i])
    if isinstance(src, ir.SelectStep):
        return value(src.source).select(src.dim, src.start + i * src.step)
    if chunks is None:
        raise LoopError(f"per-step chunk of stream {src.stream} without chunks")
    chunk, span = chunks[i]
    return chunk if src.part == "data" else span.context


def loop_channels(
    node: ir.LoopNode,
    carried: Mapping[str, Any],
    last: list[Any] | None,
    collected: Mapping[str, list[Any]],
) -> dict[str, Any]:
    """The channels a finished loop defines: terminal ones from the last iteration's outputs
    (after zero iterations: the carried initial value), accumulated ones joined."""
    result: dict[str, Any] = {}
    for ch, j in node.terminal.items():
        if last is not None:
            result[ch] = last[j]
            continue
        init = next(
            (
                carried[p.name]
                for p in node.params
                if isinstance(p.role, ir.Carried) and p.role.output == j
            ),
            None,
        )
        if init is None:
            raise LoopError(f"loop {node.name} ran no iteration, so {ch} has no value")
        result[ch] = init
    for ch, acc in node.accumulated.items():
        if not collected[ch]:
            raise LoopError(f"loop {node.name} ran no iteration, so {ch} is empty")
        result[ch] = _joined(collected[ch], acc.mode, acc.dim)
    return result


def truth(value: Any, node: ir.LoopNode) -> bool:
    """A stop value as a Python bool: one boolean per request."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise LoopError(
                f"the stop of loop {node.name} must be one boolean per request, got shape {list(value.shape)}"
            )
        return bool(value.item())
    return bool(value)


def streamed_outputs(walk: ir.Walk) -> dict[str, str]:
    """Client outputs of ``walk`` that stream item by item, each with the loop whose
    iterations send them: an output that *is* the accumulated channel of a loop of the walk
    body (not nested), and not request state. Any other output, glue computed from a streamed
    channel included (``torch.cat(pieces)[:, :n]``, ``wav * 0.5``), is sent whole when the walk
    ends. The conductor streams exactly these."""
    found: dict[str, str] = {}
    for node in walk.body.nodes:
        if not isinstance(node, ir.LoopNode):
            continue
        for ch in node.accumulated:
            for out, arg in walk.outputs.items():
                if arg == ir.Ref(ch) and out not in walk.state:
                    found[out] = node.name
    return found
