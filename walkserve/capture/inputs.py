"""Walk inputs: what a valid value is, recorded at capture, and the check that a request's
values are valid before the runtime admits it.

At capture (``input_specs``), each walk input gets an ``ir.InputSpec`` from what the sample
request showed and what the author declared (``@walk(inputs={name: capture.Input(...)})``):

    tensor    dtype as sampled; rank as sampled; dimension 0 (the batch) any size >= 1; every
              other dimension its sampled size, unless declared (``Dim``, ``"dynamic"``)
    ids       an integer tensor that an ``nn.Embedding`` reads as it is (seen while capture runs
              the sample; or declared ``vocab=``): 0 <= id < vocabulary, and every dimension
              free (an embedding reads a sequence of any length)
    floats    finite (no NaN or infinity), unless declared ``finite=False``
    int       a Python int (not a bool); a loop's trip count is >= 0, or >= 1 when the loop
              must run once (``loopsem.needs_iteration``), and a ``max_iters`` input >= 1; both
              <= ``DEFAULT_MAX_ITERATIONS`` unless declared; any other int fits in 64 bits

At admission (``check_inputs(walk, inputs)``, pure, called by the conductor's ``submit``) a
value that breaks a rule raises ``InputError``, a ``ValueError`` naming the input and the
rule; trip counts that are expressions (``range(points - 1)``) are evaluated and checked too.
``EmbeddingProbe`` is how capture sees which inputs an embedding reads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from walkserve.capture import dataflow, ir
from walkserve.capture.api import Dim, Input
from walkserve.capture.errors import CaptureError
from walkserve.capture.loopsem import LoopError, eval_int, format_int, needs_iteration

DEFAULT_MAX_ITERATIONS = 1 << 24  # 16777216: far beyond a real request, inside every int type
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}


class InputError(ValueError):
    """A request input breaks a rule of its walk: ``input`` (the name), ``rule`` (``kind``,
    ``dtype``, ``rank``, ``shape``, ``batch``, ``range``, ``vocabulary``, ``finite``,
    ``trip-count``)."""

    def __init__(self, walk: str, name: str, rule: str, message: str) -> None:
        self.walk = walk
        self.input = name
        self.rule = rule
        super().__init__(f"walk {walk!r} input {name!r}: {message} [rule: {rule}]")


# ------------------------------------------------------------------------------ capture


class EmbeddingProbe(TorchFunctionMode):
    """While capture runs a walk on the sample: which integer walk inputs reach an
    embedding unchanged (the same tensor, or a view of all of it), and the smallest
    vocabulary among those that read each. Pass ``observe_op`` to the interpreter so that the
    component doing the lookup is named."""

    def __init__(self, inputs: Mapping[str, Any]) -> None:
        super().__init__()
        self.inputs = {
            name: t
            for name, t in inputs.items()
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() > 0
        }
        self.found: dict[str, tuple[int, str]] = {}
        self._op = "a component"

    def observe_op(self, op: ir.Op, args: list[Any], kwargs: dict[str, Any]) -> None:
        self._op = op.target if op.kind == "component" else f"glue {op.target}"

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding and len(args) >= 2:
            ids, weight = args[0], args[1]
            for name, t in self.inputs.items():
                if _same_values(ids, t) and isinstance(weight, torch.Tensor):
                    size = int(weight.shape[0])
                    if name not in self.found or size < self.found[name][0]:
                        self.found[name] = (size, self._op)
        return func(*args, **kwargs)


def _same_values(a: Any, b: torch.Tensor) -> bool:
    """``a`` is ``b`` or a view of all of it."""
    if a is b:
        return True
    return (
        isinstance(a, torch.Tensor)
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def input_specs(
    walk: ir.Walk,
    declared: Mapping[str, Input],
    vocab: Mapping[str, tuple[int, str]],
) -> list[ir.WalkInput]:
    """``walk.inputs`` with their ``spec`` set (see the module docstring)."""
    names = [i.name for i in walk.inputs]
    unknown = [n for n in declared if n not in names]
    if unknown:
        raise CaptureError(
            "walk-inputs",
            f"@walk(inputs=...) of {walk.name!r} declares {unknown}, which are not its "
            f"parameters {names}",
            walk.source,
        )
    bounds = _loop_bounds(walk)
    return [
        ir.WalkInput(
            i.name,
            i.meta,
            i.default,
            _spec(walk, i, declared.get(i.name), vocab.get(i.name), bounds.get(i.name)),
        )
        for i in walk.inputs
    ]


def _loop_bounds(walk: ir.Walk) -> dict[str, tuple[int | None, str]]:
    """Int inputs that bound a loop: name -> (smallest valid value or None, why)."""
    found: dict[str, tuple[int | None, str]] = {}

    def need(name: str, least: int | None, why: str) -> None:
        old = found.get(name, (None, why))[0]
        if name not in found or (least is not None and (old is None or least > old)):
            found[name] = (least, why)

    for node in dataflow.iter_nodes(walk.body):
        if not isinstance(node, ir.LoopNode):
            continue
        if isinstance(node.trips, ir.InputTrips):
            need(
                node.trips.input, int(needs_iteration(node)), f"the trip count of loop {node.name}"
            )
        if isinstance(node.max_iters, str):
            need(node.max_iters, 1, f"max_iters of loop {node.name}")
        if isinstance(node.trips, ir.ExprTrips):
            for name in _int_leaves(node.trips.expr):
                need(name, None, f"the trip count of loop {node.name}")
    return found


def _int_leaves(expr: ir.IntExpr) -> list[str]:
    """The int walk inputs of an expression (not the tensors whose sizes it reads)."""
    if isinstance(expr, ir.IntInput):
        return [expr.name]
    if isinstance(expr, ir.IntBinOp):
        return [*_int_leaves(expr.left), *_int_leaves(expr.right)]
    return []


def _spec(
    walk: ir.Walk,
    i: ir.WalkInput,
    decl: Input | None,
    vocab: tuple[int, str] | None,
    bound: tuple[int | None, str] | None,
) -> ir.InputSpec:
    meta = i.meta
    decl = decl or Input()

    def declared_range(default: tuple[Any, Any, str | None]) -> tuple[Any, Any, str | None]:
        if isinstance(decl.vocab, int):
            return 0, decl.vocab - 1, f"the declared vocabulary ({decl.vocab} ids)"
        if decl.min is not None or decl.max is not None:
            return decl.min, decl.max, "declared"
        return default

    if isinstance(meta, ir.TensorMeta):
        rank = len(meta.shape)
        bad = [d for d in decl.dims if d >= rank]
        if bad:
            raise CaptureError(
                "walk-inputs",
                f"@walk(inputs=...) of {walk.name!r} declares dims {bad} of {i.name!r}, which "
                f"has {rank} dimensions in the sample request",
                walk.source,
            )
        ids = vocab is not None or decl.vocab is not None  # token ids: a sequence of any length
        shape: list[int | ir.DimRange] = []
        for d, size in enumerate(meta.shape):
            dim = decl.dim(d) or (Dim() if d == 0 or size is None or ids else None)
            shape.append(size if dim is None else ir.DimRange(dim.min, dim.max))  # type: ignore[arg-type]
        low, high, why = declared_range(
            (0, vocab[0] - 1, f"the vocabulary of {vocab[1]} ({vocab[0]} ids)")
            if vocab is not None
            else (None, None, None)
        )
        floating = meta.dtype in _FLOAT_DTYPES
        return ir.InputSpec(
            "tensor", meta.dtype, shape, low, high, why, finite=floating and decl.finite
        )
    if isinstance(meta, ir.ScalarMeta):
        if meta.kind == "int":
            default: tuple[int | None, int, str | None] = (INT64_MIN, INT64_MAX, "a 64-bit int")
            if bound is not None:
                default = (bound[0], DEFAULT_MAX_ITERATIONS, bound[1])
            low, high, why = declared_range(default)
            return ir.InputSpec("int", min=low, max=high, bounds=why)
        if meta.kind == "float":
            low, high, why = declared_range((None, None, None))
            return ir.InputSpec("float", min=low, max=high, bounds=why, finite=decl.finite)
        return ir.InputSpec("bool")
    return ir.InputSpec("any")


# ------------------------------------------------------------------------------ admission


def check_inputs(walk: ir.Walk, inputs: Mapping[str, Any]) -> None:
    """Raise ``InputError`` if a value in ``inputs`` breaks its spec in ``walk``, or a trip
    count of ``walk`` that they determine is negative, zero where the loop must run, or above
    the maximum. Names the walk does not take are ignored (the caller decides about them)."""
    for i in walk.inputs:
        if i.spec is not None and i.name in inputs:
            _check_value(walk.name, i.name, inputs[i.name], i.spec)
    _check_trips(walk, inputs)


def _check_value(walk: str, name: str, value: Any, spec: ir.InputSpec) -> None:
    def fail(rule: str, message: str) -> None:
        raise InputError(walk, name, rule, message)

    if spec.kind == "any":
        return
    if spec.kind == "tensor":
        if not isinstance(value, torch.Tensor):
            fail("kind", f"must be a tensor ({_describe_spec(spec)}), got {type(value).__name__}")
        _check_tensor(value, spec, fail)
        return
    scalar = _scalar(value)
    ok = {
        "int": isinstance(scalar, int) and not isinstance(scalar, bool),
        "float": isinstance(scalar, int | float) and not isinstance(scalar, bool),
        "bool": isinstance(scalar, bool),
    }[spec.kind]
    if not ok:
        fail("kind", f"must be {'an' if spec.kind == 'int' else 'a'} {spec.kind}, got {value!r}")
    if spec.finite and isinstance(scalar, float) and not torch.isfinite(torch.tensor(scalar)):
        fail("finite", f"must be a finite number, got {scalar!r}")
    _check_range(scalar, spec, fail)


def _scalar(value: Any) -> Any:
    """A Python scalar, or the item of a one-element tensor (as loop bounds accept)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


# a dtype's name as specs write it ("float32"), made once per dtype: every admission asks
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _check_tensor(t: torch.Tensor, spec: ir.InputSpec, fail: Any) -> None:
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        dtype = _DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    if dtype != spec.dtype:
        fail("dtype", f"must be {spec.dtype}, got {dtype}")
    shape = spec.shape or []
    if t.dim() != len(shape):
        fail(
            "rank",
            f"must have {len(shape)} dimensions ({_describe_spec(spec)}), got shape {list(t.shape)}",
        )
    for d, (size, want) in enumerate(zip(t.shape, shape)):
        if isinstance(want, int):
            if size != want:
                fail(
                    "batch" if d == 0 else "shape",
                    f"dimension {d} must be {want} ({_describe_spec(spec)}), got shape "
                    f"{list(t.shape)}; the walk was captured with that size: if it may vary, "
                    f"declare it (@walk(inputs={{name: Input(dims={{{d}: 'dynamic'}})}}))",
                )
        elif isinstance(want, ir.DimRange) and not (
            want.min <= size and (want.max is None or size <= want.max)
        ):
            what = "the batch dimension 0" if d == 0 else f"dimension {d}"
            fail(
                "batch" if d == 0 else "shape",
                f"{what} must be in {_fmt_range(want.min, want.max)}, got {size}",
            )
    ranged = spec.min is not None or spec.max is not None
    if t.numel() == 0 or not (spec.finite or ranged):
        return
    if t.is_complex():  # no order: its finiteness alone
        if spec.finite and not bool(torch.isfinite(t).all()):
            fail("finite", "must hold finite numbers only (no NaN or infinity)")
        return
    low, high = _extremes(t)
    if spec.finite and not (math.isfinite(low) and math.isfinite(high)):
        fail("finite", "must hold finite numbers only (no NaN or infinity)")
    if ranged:
        _check_range(low, spec, fail, "its smallest value ")
        _check_range(high, spec, fail, "its largest value ")


# integer tensors of at most this many elements (token ids, actions) are read as Python
# numbers, one call, instead of reduced, a reduction and two reads: at admission, its code
# cold, each torch call costs ~10-30 us on the 2-core VM. Floating tensors are reduced: a NaN
# among Python numbers takes a scan of its own
SMALL_TENSOR = 256


def _extremes(t: torch.Tensor) -> tuple[Any, Any]:
    """The smallest and largest values of ``t`` (not empty, not complex); both NaN when it
    holds a NaN, as the reduction gives them (an infinity is one of them)."""
    if t.numel() <= SMALL_TENSOR and not t.is_floating_point():
        if t.dim() == 0:
            value = t.item()
            return value, value
        rows = t.tolist() if t.dim() <= 2 else t.reshape(-1).tolist()  # one call either way
        if t.dim() == 2:
            rows = list(itertools.chain.from_iterable(rows))
        return min(rows), max(rows)
    # one reduction for both rules: a NaN propagates into the smallest and largest values
    smallest, largest = torch.aminmax(t)
    return smallest.item(), largest.item()


def _check_range(value: Any, spec: ir.InputSpec, fail: Any, what: str = "") -> None:
    if (spec.min is not None and value < spec.min) or (spec.max is not None and value > spec.max):
        rule = "vocabulary" if spec.bounds and "vocabulary" in spec.bounds else "range"
        why = f" ({spec.bounds})" if spec.bounds else ""
        fail(rule, f"{what}must be in {_fmt_range(spec.min, spec.max)}{why}, got {value!r}")


def _check_trips(walk: ir.Walk, inputs: Mapping[str, Any]) -> None:
    """Trip counts that are expressions of walk inputs, evaluated for this request."""
    given = ir.with_defaults(walk, inputs)
    limits = {  # declared maxima raise the limit on an expression's count
        i.name: i.spec.max
        for i in walk.inputs
        if i.spec is not None and i.spec.bounds == "declared"
    }
    for node, expr, reads in _expr_loops(walk):
        if not reads or not all(n in given for n in reads):
            continue
        try:
            count = eval_int(expr, given)
        except LoopError as e:
            raise InputError(walk.name, reads[0], "trip-count", str(e)) from None
        least = int(needs_iteration(node))
        most = max(
            [DEFAULT_MAX_ITERATIONS, *(m for n in reads if isinstance(m := limits.get(n), int))]
        )
        if not least <= count <= most:
            text = format_int(expr)
            values = ", ".join(
                f"{n} = {_scalar(given[n])!r}" for n in reads if not _is_tensor(given[n])
            )
            raise InputError(
                walk.name,
                reads[0],
                "trip-count",
                f"loop {node.name} runs {text} times, which is {count} for {values or 'these sizes'}; "
                f"it must be in {_fmt_range(least, most)}",
            )


# a walk's loops whose trip count is an expression, with the inputs it reads, found once per
# walk (every admission asks): id -> (the walk, its loops)
_EXPR_LOOPS: dict[int, tuple[ir.Walk, list[tuple[ir.LoopNode, ir.IntExpr, list[str]]]]] = {}


def _expr_loops(walk: ir.Walk) -> list[tuple[ir.LoopNode, ir.IntExpr, list[str]]]:
    cached = _EXPR_LOOPS.get(id(walk))
    if cached is not None and cached[0] is walk:
        return cached[1]
    loops = [
        (node, node.trips.expr, dataflow.expr_inputs(node.trips.expr))
        for node in dataflow.iter_nodes(walk.body)
        if isinstance(node, ir.LoopNode) and isinstance(node.trips, ir.ExprTrips)
    ]
    if len(_EXPR_LOOPS) >= 1024:  # walks of models captured and dropped: start again
        _EXPR_LOOPS.clear()
    _EXPR_LOOPS[id(walk)] = (walk, loops)
    return loops


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() != 1


def _fmt_range(low: Any, high: Any) -> str:
    if high is None:
        return f"[{low}, any]"
    if low is None:
        return f"[any, {high}]"
    return f"[{low}, {high}]"


def _describe_spec(spec: ir.InputSpec) -> str:
    dims = [
        str(d) if isinstance(d, int) else ("B" if i == 0 else _fmt_range(d.min, d.max))
        for i, d in enumerate(spec.shape or [])
    ]
    return f"{spec.dtype} [{', '.join(dims)}]"
