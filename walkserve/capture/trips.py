"""Trip counts from the request: what ``range(...)`` and ``iterations(...)`` over traced
values mean while a walk is traced.

``range(n)`` with ``n`` an int walk input runs ``SAMPLE_ITERATIONS`` sample iterations
and records the loop's trip count as an integer expression of walk inputs (``ir.IntExpr``)::

    range(n)               IntInput(n)                      -> ir.InputTrips("n")
    range(points - 1)      binop(sub, input points, lit 1)  -> ir.ExprTrips(...)
    range(1, n, 2)         (n - 1 + 1) // 2, iteration i gets k = 1 + 2 i
    range(x.shape[1])      IntSize(x, 1)                    (also x.size(1), len(x): dim 0)

The expression is read back from the fx nodes that computed the traced bound: walk inputs
(placeholders of the walk graph), their sizes, ints, and ``+ - * // %``; anything else is a
``CaptureError`` (rule ``trip-count``). What crosses the boundary: ``traced_range``,
``traced_iterations``, ``trip_expr``, used by the tracer's hooks.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import fx

from walkserve.capture import ir
from walkserve.capture.errors import CaptureError, user_source

if TYPE_CHECKING:
    from walkserve.capture.tracer import WalkTracer

# Sample iterations the tracer lets a dynamic, streamed or input-bounded loop run: enough to
# tell carried from per-step arguments and to check that per-step ints are affine.
SAMPLE_ITERATIONS = 3


def traced_range(tracer: WalkTracer, *args: Any) -> TracedRange:
    """``range(...)`` with a traced argument (see ``shims``): a loop over a trip count
    that is an integer expression of walk inputs; ``start`` and ``step`` Python ints."""
    start, step = 0, 1
    if len(args) == 1:
        stop = args[0]
    elif len(args) in (2, 3):
        start, stop = args[0], args[1]
        step = args[2] if len(args) == 3 else 1
    else:
        raise CaptureError(
            "range", f"range expected 1 to 3 arguments, got {len(args)}", user_source()
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, step)):
        raise CaptureError(
            "range",
            "range(start, stop, step) over a traced stop needs Python ints for start and "
            "step; only the stop may come from walk inputs",
            user_source(),
        )
    if step == 0:
        raise CaptureError("range", "range() step must not be zero", user_source())
    expr = trip_expr(tracer, stop, "range")
    # len(range(start, stop, step)) for step > 0: ceil((stop - start) / step); and with
    # the signs flipped for step < 0.
    if step > 0:
        count = _sub(expr, start)
    else:
        count = ir.IntBinOp("sub", ir.IntLit(start), expr)
    if abs(step) != 1:
        count = ir.IntBinOp("floordiv", _add(count, abs(step) - 1), ir.IntLit(abs(step)))
    return TracedRange(tracer, count, start, step, user_source())


def traced_iterations(
    tracer: WalkTracer, count: ir.IntExpr, start: int, step: int
) -> Iterator[int]:
    for i in range(SAMPLE_ITERATIONS):
        tracer.pending_trip = count
        yield start + i * step
    tracer.pending_trip = None


def trip_expr(tracer: WalkTracer, value: Any, what: str) -> ir.IntExpr:
    """An integer expression of walk inputs from a traced value (or a Python int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return ir.IntLit(value)
    if isinstance(value, fx.Proxy):
        value = value.node
    if not isinstance(value, fx.Node):
        raise CaptureError(
            "trip-count",
            f"{what}() needs an int, got {type(value).__name__}",
            user_source(),
        )
    return _node_expr(tracer, value, what)


def _node_expr(tracer: WalkTracer, node: fx.Node, what: str) -> ir.IntExpr:
    ops = {
        operator.add: "add",
        operator.sub: "sub",
        operator.mul: "mul",
        operator.floordiv: "floordiv",
        operator.mod: "mod",
    }
    if node.op == "placeholder" and id(node.graph) not in tracer.body_graphs:
        return ir.IntInput(str(node.target))
    if node.op == "call_function" and node.target in ops and len(node.args) == 2:
        left, right = (trip_expr(tracer, a, what) for a in node.args)
        return ir.IntBinOp(ops[node.target], left, right)  # type: ignore[arg-type]
    if node.op == "call_function" and node.target is operator.neg:
        return ir.IntBinOp("sub", ir.IntLit(0), trip_expr(tracer, node.args[0], what))
    size = _size_of_input(node, tracer.body_graphs)
    if size is not None:
        return size
    raise CaptureError(
        "trip-count",
        f"the trip count of {what}() must be an integer expression of int walk inputs, "
        "walk inputs' sizes (x.shape[d], x.size(d), len(x)) and Python ints, combined with "
        f"+ - * // %; it is computed by {node.format_node()}. Inside a @loop body, pass the "
        "count from the walk or loop in the walk",
        user_source(),
    )


class TracedRange:
    """What ``range(...)`` over a traced bound returns while capturing: iterating it records
    a loop over ``count`` iterations (the tracer runs ``SAMPLE_ITERATIONS`` of them)."""

    def __init__(
        self, tracer: WalkTracer, count: ir.IntExpr, start: int, step: int, source: str | None
    ) -> None:
        self.tracer, self.count, self.start, self.step, self.source = (
            tracer,
            count,
            start,
            step,
            source,
        )

    def __iter__(self) -> Iterator[int]:
        return traced_iterations(self.tracer, self.count, self.start, self.step)

    def __reversed__(self) -> Iterator[int]:
        raise CaptureError(
            "range",
            "reversed(range(n)) over a traced n: iteration i would get n - 1 - i, which is not "
            "known while capturing. Iterate forward and flip what you index: "
            "`for i in range(n): t = ts_flipped[i]` with `ts_flipped = ts.flip(0)`",
            user_source(),
        )

    def __len__(self) -> int:
        raise CaptureError(
            "range",
            "len() of a range over a traced bound is not known while capturing; use the bound "
            "itself",
            user_source(),
        )


def _add(expr: ir.IntExpr, k: int) -> ir.IntExpr:
    return expr if k == 0 else ir.IntBinOp("add", expr, ir.IntLit(k))


def _sub(expr: ir.IntExpr, k: int) -> ir.IntExpr:
    return expr if k == 0 else ir.IntBinOp("sub", expr, ir.IntLit(k))


def _size_of_input(node: fx.Node, body_graphs: set[int]) -> ir.IntSize | None:
    """``x.shape[d]``, ``x.size(d)``, ``x.size()[d]``, ``len(x)`` of a walk input ``x``."""

    def walk_input(n: Any) -> str | None:
        if isinstance(n, fx.Node) and n.op == "placeholder" and id(n.graph) not in body_graphs:
            return str(n.target)
        return None

    if node.op == "call_function" and node.target is len:
        name = walk_input(node.args[0])
        return None if name is None else ir.IntSize(name, 0)
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2:
        name, dim = walk_input(node.args[0]), node.args[1]
        return ir.IntSize(name, dim) if name is not None and isinstance(dim, int) else None
    if node.op == "call_function" and node.target is operator.getitem:
        base, dim = node.args
        if not isinstance(base, fx.Node) or not isinstance(dim, int):
            return None
        is_shape = base.op == "call_function" and base.target is getattr and base.args[1] == "shape"
        is_size = base.op == "call_method" and base.target == "size" and len(base.args) == 1
        if is_shape or is_size:
            name = walk_input(base.args[0])
            return None if name is None else ir.IntSize(name, dim)
    return None
