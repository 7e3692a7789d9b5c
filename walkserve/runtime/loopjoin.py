"""Joined calls of a loop's body node: how runs of one simple loop share one component call.

The loop stepper (``loopstep``) asks ``joinable`` once per loop; for runs at its body node it
groups them by ``Join.key`` of their materialized calls, concatenates each group's arguments
(``Join.join``), hands the runner one item, and splits the values back per run
(``Join.split``)::

    join = joinable(body, ops, ("rollout", "step"), runner.joinable())
    key = join.key(call)                       # None: this call is not joined
    call, rows = join.join([call_a, call_b])   # batched arguments concatenated, rows per run
    parts = join.split(values, rows)           # {value: [per run]}, None: not as captured

A loop is joinable when its body is one component node that the runner takes joined (a plain
batched callable, no ``forward_batch``) and whose fused glue only unpacks the component's tuple
(``getitem`` of a constant): then one call over the concatenation is exactly what
``BatchedComponent`` makes of a group of the same calls, and each run's rows of every value are
its own values. Calls are keyed as ``BatchedComponent._groups`` groups them, stricter where that
would compare values: a non-batched tensor or an object argument is never joined (the
component's own grouping judges those).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.lowering.plan import NodePlan

__all__ = ["Join", "joinable"]

Call = tuple[list[Any], dict[str, Any]]
_PLAIN = (int, float, str, bool, type(None))


@dataclass(frozen=True)
class Join:
    """A joinable loop's body node: the batch dimensions of its component's arguments and of
    the values it makes (None: not batched, equal for every run)."""

    node: str
    in_dims: tuple[Any, ...]
    kw_dims: dict[str, Any]
    out_dims: dict[str, int | None]

    def key(self, call: Call) -> tuple[Any, ...] | None:
        """What calls must agree on to be joined, or None when this one is not joined."""
        args, kwargs = call
        if len(args) != len(self.in_dims):
            return None
        key: list[Any] = [self.node, frozenset(kwargs)]
        pairs = [*zip(args, self.in_dims), *((kwargs[k], self.kw_dims.get(k)) for k in kwargs)]
        for x, d in pairs:
            if isinstance(d, int):
                if not isinstance(x, torch.Tensor) or not 0 <= d < x.dim():
                    return None
                key.append((x.dtype, x.device, x.shape[:d], x.shape[d + 1 :]))
            elif isinstance(x, _PLAIN):
                key.append((type(x), x))
            else:
                return None
        return tuple(key)

    def join(self, calls: Sequence[Call]) -> tuple[Call, list[int]]:
        """One call over ``calls`` (equal keys) and each call's rows of the batch dimension."""
        args = [_cat([c[0][j] for c in calls], d) for j, d in enumerate(self.in_dims)]
        kwargs = {k: _cat([c[1][k] for c in calls], self.kw_dims.get(k)) for k in calls[0][1]}
        return (args, kwargs), [self._rows(c) for c in calls]

    def split(self, values: Mapping[str, Any], rows: list[int]) -> dict[str, list[Any]] | None:
        """Each value of a joined call as one value per run, or None when one is not batched
        as captured (then the runs take the node one by one)."""
        parts: dict[str, list[Any]] = {}
        for name, value in values.items():
            dim = self.out_dims.get(name)
            if dim is None:
                parts[name] = [value] * len(rows)
                continue
            if not isinstance(value, torch.Tensor) or value.dim() <= dim:
                return None
            if value.shape[dim] != sum(rows):
                return None
            parts[name] = list(torch.split(value, rows, dim=dim))
        return parts

    def _rows(self, call: Call) -> int:
        for x, d in zip(call[0], self.in_dims):
            if isinstance(d, int):
                return int(x.shape[d])
        return next(int(call[1][k].shape[d]) for k, d in self.kw_dims.items() if isinstance(d, int))


def joinable(
    body: Sequence[NodePlan],
    ops: Mapping[str, ir.Op],
    where: tuple[str, str],
    joins: Collection[tuple[str, str]],
) -> Join | None:
    """The ``Join`` of a loop with this body, or None (see the module docstring). ``where``:
    (walk, loop); ``joins``: the (walk, node) the runner takes joined."""
    walk, _ = where
    if len(body) != 1 or body[0].kind != "component" or (walk, body[0].name) not in joins:
        return None
    node = body[0]
    comp = node.ops[0]
    out_dims: dict[str, int | None] = {}
    if isinstance(node.out_dim, int) or node.out_dim is None:
        out_dims[comp] = node.out_dim
    elif comp in node.outputs:
        return None  # the tuple itself is read: kept per run
    for name in node.ops[1:]:
        dim = _unpacked(ops[name], comp, node.out_dim)
        if dim is False:
            return None
        out_dims[name] = dim  # type: ignore[assignment]
    dims = (*node.in_dims, *node.kw_dims.values())
    if not any(isinstance(d, int) for d in dims):
        return None
    if not any(isinstance(d, int) for d in out_dims.values()):
        return None
    return Join(node.name, tuple(node.in_dims), dict(node.kw_dims), out_dims)


def _unpacked(op: ir.Op, comp: str, out_dim: Any) -> int | bool | None:
    """The batch dimension of ``op`` when it is ``comp``'s tuple element by a constant index
    (int or None), else False."""
    if (
        op.kind != "glue"
        or op.target != "function:operator.getitem"
        or len(op.args) != 2
        or op.kwargs
        or op.args[0] != ir.Ref(comp)
        or not isinstance(op.args[1], ir.Const)
        or type(op.args[1].value) is not int
        or not isinstance(out_dim, (list, tuple))
        or not -len(out_dim) <= op.args[1].value < len(out_dim)
    ):
        return False
    dim = out_dim[op.args[1].value]
    return dim if isinstance(dim, int) or dim is None else False


def _cat(values: list[Any], dim: Any) -> Any:
    return torch.cat(values, dim=dim) if isinstance(dim, int) else values[0]
