"""Loop parameters: the role each argument of a ``@loop`` body plays, read from the values
the tracer recorded for it in every iteration (``records.Iteration.args``).

    the argument of iteration i+1 is output j of iteration i, for every i  -> carried (j)
    the same value in every iteration (a node, a tensor, an equal constant) -> invariant
    Python ints start + i * step                                            -> affine
    chunk i of the stream being iterated (or its left-context length)       -> chunk, context
    x[..., start + i * step, ...] with one int index varying                -> select
    Python values of a loop of a fixed count (not traced)                   -> table
    anything else                                                           -> CaptureError

A role is a ``ParamPlan``: ``loops`` calls ``classify`` for each traced parameter while it
finalizes a loop (and adds an invariant plan per outer value a moved stop check reads), and
``convert`` turns each into an ``ir.LoopParam`` role (``ir.Carried``, ``ir.Invariant``,
``ir.PerStep``). Outer values a parameter is made from are handed to the
loop node's ``deps`` through the ``dep`` callback; ``ParamPlan.dep`` is their index there.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx

from walkserve.capture.errors import CaptureError
from walkserve.capture.records import LoopRecord, _stream_chunk, _stream_context


@dataclass
class ParamPlan:
    """One body parameter: its role and where its outer value sits in ``deps``."""

    name: str
    role: Literal["carried", "invariant", "affine", "table", "select", "chunk", "context"]
    dep: int | None = None  # index into the _loop_node's deps list
    output: int = 0  # carried: body output index
    start: int = 0
    step: int = 0
    dim: int = 0
    table: list[Any] = field(default_factory=list)


def classify(
    record: LoopRecord,
    pname: str,
    values: list[Any],
    its: list[Any],
    bounded_by_count: bool,
    dep: Any,
) -> ParamPlan:
    """The role of body parameter ``pname``, from ``values``, its argument in each recorded
    iteration ``its``; ``dep(value)`` adds an outer value the loop node reads and returns its
    index in ``deps``. A value that fits no role is a ``CaptureError`` (``per-step-input``)."""
    n = len(values)
    where = record.source
    if n >= 2:
        sources = [
            its[i - 1].outputs.index(v.node)
            if isinstance(v, fx.Proxy) and v.node in its[i - 1].outputs
            else None
            for i, v in enumerate(values[1:], start=1)
        ]
        if all(s is not None for s in sources):
            if len(set(sources)) != 1:
                raise CaptureError(
                    "carried-consistency",
                    f"parameter '{pname}' of loop body {record.name} receives different outputs of "
                    "the previous iteration in different iterations",
                    where,
                )
            return ParamPlan(pname, "carried", dep(values[0]), output=sources[0])  # type: ignore[arg-type]
        if any(s is not None for s in sources):
            raise CaptureError(
                "carried-consistency",
                f"parameter '{pname}' of loop body {record.name} is the previous iteration's output "
                "in some iterations and not in others",
                where,
            )
    if all(_same(values[0], v) for v in values):
        return ParamPlan(pname, "invariant", dep(values[0]))

    # Per-step values.
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        step = values[1] - values[0]
        if all(v == values[0] + i * step for i, v in enumerate(values)):
            return ParamPlan(pname, "affine", start=values[0], step=step)
    if all(isinstance(v, fx.Proxy) for v in values):
        nodes = [v.node for v in values]
        if all(nd.target in (_stream_chunk, _stream_context) for nd in nodes):
            stream = record.stream
            if stream is None or any(
                nd.args[1] != stream.key or nd.args[2] != i for i, nd in enumerate(nodes)
            ):
                raise CaptureError(
                    "stream-consumer",
                    f"parameter '{pname}' of loop body {record.name} must receive the chunks of the "
                    "stream being iterated, one per iteration, in order",
                    where,
                )
            role: Literal["chunk", "context"] = (
                "chunk" if nodes[0].target is _stream_chunk else "context"
            )
            return ParamPlan(pname, role, dep(nodes[0].args[0]))
        select = _select_pattern(nodes)
        if select is not None:
            base, dim, start, step = select
            return ParamPlan(pname, "select", dep(base), start=start, step=step, dim=dim)
    if bounded_by_count and all(not isinstance(v, fx.Proxy) for v in values):
        return ParamPlan(pname, "table", table=list(values))
    raise CaptureError(
        "per-step-input",
        f"parameter '{pname}' of loop body {record.name} changes every iteration in a way capture "
        "cannot express; per-iteration values must be Python ints affine in the loop index, "
        "`x[k]` / `x[:, k]` indexing with the loop index, stream chunks, or (in loops of a fixed "
        "count) Python numbers; otherwise compute it inside the body or carry it",
        where,
    )


def _select_pattern(nodes: list[fx.Node]) -> tuple[fx.Node, int, int, int] | None:
    """``x[k]`` / ``x[:, :, k]`` with one int index affine in the iteration: (x, dim, start,
    step), else None."""
    if not all(nd.op == "call_function" and nd.target is operator.getitem for nd in nodes):
        return None
    bases = {nd.args[0] for nd in nodes}
    if len(bases) != 1:
        return None
    indices = [nd.args[1] if isinstance(nd.args[1], tuple) else (nd.args[1],) for nd in nodes]
    if len({len(ix) for ix in indices}) != 1:
        return None
    width = len(indices[0])
    varying = [p for p in range(width) if len({repr(ix[p]) for ix in indices}) > 1]
    if len(varying) != 1:
        return None
    pos = varying[0]
    full = slice(None, None, None)
    if any(ix[p] != full for ix in indices for p in range(width) if p != pos):
        return None
    ints: list[int] = []
    for ix in indices:
        v = ix[pos]
        if not isinstance(v, int) or isinstance(v, bool):
            return None
        ints.append(v)
    step = ints[1] - ints[0]
    if any(v != ints[0] + i * step for i, v in enumerate(ints)):
        return None
    base = nodes[0].args[0]
    assert isinstance(base, fx.Node)
    return base, pos, ints[0], step


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Proxy) or isinstance(b, fx.Proxy):
        return isinstance(a, fx.Proxy) and isinstance(b, fx.Proxy) and a.node is b.node
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b
