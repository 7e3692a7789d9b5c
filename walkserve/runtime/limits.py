"""Bounded work: how much one request may ask a server to run, checked before it is admitted.

A walk's captured rules (``capture.inputs``) say what a *valid* value is; these limits say what
this *server* takes (``serve(limits=...)``, ``walkserve serve --max-walk-input-length`` /
``--max-walk-loop-bound`` / ``--max-walk-batch``), so that one request cannot hold a rank for
minutes (a 100k-token prompt, a loop of a million steps). Pure: no torch beyond reading
tensor shapes, no state.

    length    every dimension but the batch of a tensor walk input whose size the request
              chooses (declared dynamic at capture, or token ids): at most ``max_input_length``
              (``input_lengths`` overrides it per input name)
    loop      every loop bound a request's inputs determine (a trip count given as an input or
              an expression of inputs, a ``max_iters`` input; the smaller of the two when both
              are): at most ``max_loop_bound``
    fan-out   a request's rows, the batch dimension 0 of its batched tensor inputs: each row
              is a sequence the engines run (its own KV, its own samples); at most
              ``max_batch``, and ``fan_out`` is what admission counts for it

The inputs checked are those of the request's walk and of the walks its static ``next`` chain
reaches that no earlier walk produces (the same chain the conductor checks). A value over a
limit raises ``capture.inputs.InputError`` with rule ``limit``, naming the input, its value and
the limit (the HTTP layer answers it with a 400 naming the input).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from walkserve.capture import dataflow, ir
from walkserve.capture.inputs import InputError
from walkserve.capture.loopsem import LoopError, eval_int, format_int

__all__ = ["WalkLimits", "check_limits", "fan_out"]


@dataclass(frozen=True)
class WalkLimits:
    """Per-request limits of a server (see the module docstring); None: no limit beyond the
    walk's captured rules. ``input_lengths``: input name -> its own length limit (replaces
    ``max_input_length`` for that input, e.g. a model profile's longest prompt)."""

    max_input_length: int | None = None
    max_loop_bound: int | None = None
    max_batch: int | None = None
    input_lengths: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_input_length", "max_loop_bound", "max_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        for name, value in self.input_lengths.items():
            if isinstance(value, bool) or value < 1:
                raise ValueError(f"input_lengths[{name!r}] must be >= 1, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return (
            self.max_input_length is None
            and self.max_loop_bound is None
            and self.max_batch is None
            and not self.input_lengths
        )


def check_limits(
    graph: ir.WalkGraph, walk: str, inputs: Mapping[str, Any], limits: WalkLimits
) -> None:
    """Raise ``InputError`` (rule ``limit``) if a request starting at ``walk`` with ``inputs``
    asks for more than ``limits`` allow. Inputs the walks do not take are ignored (the
    conductor refuses them); values of the wrong kind are left to the captured rules."""
    if limits.unlimited:
        return
    for w, given in _chain(graph, walk, inputs):
        for i in w.inputs:
            value = given.get(i.name)
            if isinstance(value, torch.Tensor) and i.spec is not None and i.spec.kind == "tensor":
                _check_tensor(w.name, i.name, value, i.spec, limits)
        if limits.max_loop_bound is not None:
            _check_loops(w, given, limits.max_loop_bound)


def fan_out(graph: ir.WalkGraph, walk: str, inputs: Mapping[str, Any]) -> int:
    """The rows a request runs: the largest batch dimension among its batched tensor inputs
    (1 when it has none)."""
    rows = 1
    for w, given in _chain(graph, walk, inputs):
        for i in w.inputs:
            value = given.get(i.name)
            if _batched(i.spec) and isinstance(value, torch.Tensor) and value.dim() > 0:
                rows = max(rows, int(value.shape[0]))
    return rows


def _chain(
    graph: ir.WalkGraph, walk: str, inputs: Mapping[str, Any]
) -> Iterator[tuple[ir.Walk, dict[str, Any]]]:
    """The walks of the request's static ``next`` chain, each with the inputs it reads from
    the request (not those an earlier walk of the chain produces) and its defaults."""
    produced: set[str] = set()
    seen: set[str] = set()
    current: str | None = walk
    while current is not None and current not in seen and current in graph.walks:
        seen.add(current)
        w = graph.walks[current]
        given = {k: v for k, v in inputs.items() if k not in produced}
        yield w, ir.with_defaults(w, given)
        produced |= set(w.outputs)
        current = w.next


def _batched(spec: ir.InputSpec | None) -> bool:
    shape = spec.shape if spec is not None and spec.kind == "tensor" else None
    return bool(shape) and isinstance(shape[0], ir.DimRange)  # type: ignore[index]


def _check_tensor(
    walk: str, name: str, t: torch.Tensor, spec: ir.InputSpec, limits: WalkLimits
) -> None:
    shape = spec.shape or []
    rows = t.shape[0] if _batched(spec) and t.dim() > 0 else 1
    if limits.max_batch is not None and rows > limits.max_batch:
        raise InputError(
            walk,
            name,
            "limit",
            f"has {rows} rows (dimension 0, the batch); this server runs at most "
            f"{limits.max_batch} rows per request (max_batch, --max-walk-batch): send "
            "fewer per request",
        )
    most = limits.input_lengths.get(name, limits.max_input_length)
    if most is None:
        return
    for d in range(1, min(t.dim(), len(shape))):
        if isinstance(shape[d], ir.DimRange) and t.shape[d] > most:
            raise InputError(
                walk,
                name,
                "limit",
                f"dimension {d} is {t.shape[d]} long; this server takes at most {most} "
                f"(max_input_length, --max-walk-input-length) in any dimension but the batch",
            )


def _check_loops(w: ir.Walk, given: Mapping[str, Any], most: int) -> None:
    for node in dataflow.iter_nodes(w.body):
        if not isinstance(node, ir.LoopNode):
            continue
        bound = _bound(node, given)
        if bound is None or bound[0] <= most:
            continue
        count, name, what = bound
        raise InputError(
            w.name,
            name,
            "limit",
            f"{what} makes loop {node.name} run up to {count} iterations; this server runs at "
            f"most {most} (max_loop_bound, --max-walk-loop-bound)",
        )


def _bound(node: ir.LoopNode, given: Mapping[str, Any]) -> tuple[int, str, str] | None:
    """The loop's bound as this request's inputs set it: (iterations, the input that sets
    it, how), or None when they do not set it (a fixed count, a stream's chunks)."""
    found: tuple[int, str, str] | None = None
    trips = node.trips
    if isinstance(trips, ir.InputTrips):
        count = _int(given.get(trips.input))
        if count is not None:
            found = (count, trips.input, f"{trips.input} = {count}")
    elif isinstance(trips, ir.ExprTrips):
        reads = dataflow.expr_inputs(trips.expr)
        if reads and all(n in given for n in reads):
            try:
                count = eval_int(trips.expr, given)
            except LoopError:
                count = None  # the captured rules name it
            if count is not None:
                found = (count, reads[0], f"{format_int(trips.expr)} = {count}")
    if isinstance(node.max_iters, str):
        cap = _int(given.get(node.max_iters))
        if cap is not None and (found is None or cap < found[0]):
            found = (cap, node.max_iters, f"{node.max_iters} = {cap}")
    elif isinstance(node.max_iters, int) and found is not None and node.max_iters < found[0]:
        found = (node.max_iters, found[1], f"{found[2]} (capped at max_iters {node.max_iters})")
    return found


def _int(value: Any) -> int | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None
