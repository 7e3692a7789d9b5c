"""Resolution of a placement: which ranks run each op node of each walk of a model.

``resolve(placement, captured)`` gives every op node of every walk of a ``CapturedModel`` its
rank list (the review's ``pi(n, w)``, section 6) as a ``ResolvedPlacement`` (frozen
dataclasses; the runtime's rank map reads it), checking that the placement's rules name walks,
nodes and components the model has and warning when nodes meant to run concurrently share a
rank. The placement itself (its rules, file format and validation) is ``placement.py``.

Resolution, per walk and per op node (loop bodies included; a loop node itself is not placed,
the nodes of its body are)::

    component op   its walk:node rule, else its component's rule, else rank 0
    glue op        the ranks of a component node, the first of:
                     the component whose structured output (a tuple) it unpacks
                     the first component (walk order) its value reaches through glue, loop
                       parameters and channels (``valueflow``)
                     the component the glue op reading its value follows
                     the last component producing its inputs
                     the walk's first component (else rank 0)
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from types import MappingProxyType
from typing import Any, Literal

from typeguard import typechecked

from walkserve.capture import dataflow, ir
from walkserve.capture.model import CapturedModel
from walkserve.capture.sections import parallel_groups
from walkserve.lowering.placement import Placement, PlacementError, PlacementWarning, split_key
from walkserve.lowering.valueflow import ValueFlow

__all__ = ["NodePlacement", "ResolvedPlacement", "resolve"]

Source = Literal[
    "node_rule", "component_rule", "default", "unpacks", "consumer", "reader", "producer", "walk"
]


@dataclass(frozen=True)
class NodePlacement:
    """Where one op node of one walk runs. ``source`` says why: a rule (``anchor`` is its
    key), the default rank, or, for glue, how it found the component node ``anchor`` whose
    ranks it shares (see ``_place_glue``)."""

    walk: str
    node: str
    kind: Literal["component", "glue"]
    target: str  # the component path, or the glue op's target
    ranks: tuple[int, ...]
    tensor_parallel: int
    replicas: int
    source: Source
    anchor: str | None = None


@dataclass(frozen=True)
class ResolvedPlacement:
    """Every op node of every walk with its ranks (``walks[walk][node]``, in walk order; loop
    nodes are absent, their body nodes present), and the messages of the ``PlacementWarning``
    resolution issued."""

    placement: Placement
    walks: Mapping[str, Mapping[str, NodePlacement]]
    warnings: tuple[str, ...] = ()

    def node(self, walk: str, node: str) -> NodePlacement:
        return self.walks[walk][node]

    def ranks(self, walk: str, node: str) -> tuple[int, ...]:
        return self.walks[walk][node].ranks

    def nodes(self) -> Iterator[NodePlacement]:
        for placed in self.walks.values():
            yield from placed.values()

    def on_rank(self, rank: int) -> list[NodePlacement]:
        return [p for p in self.nodes() if rank in p.ranks]


# ------------------------------------------------------------------------------ resolve


@typechecked
def resolve(placement: Placement, captured: CapturedModel) -> ResolvedPlacement:
    """The ranks of every op node of every walk (see the module docstring). Raises
    ``PlacementError`` for rules naming unknown walks, nodes or components; warns
    (``PlacementWarning``, also in ``.warnings``) when concurrent nodes share a rank."""
    for key in placement.rules:
        _check_rule_target(key, captured)
    for entry in placement.concurrent:
        for key in entry:
            _check_rule_target(key, captured, where="concurrent")
    _check_concurrent_groups(placement, captured)
    walks = {
        name: MappingProxyType(_place_walk(placement, walk))
        for name, walk in captured.walks.items()
    }
    resolved = ResolvedPlacement(placement, MappingProxyType(walks))
    found = tuple(_concurrency_warnings(placement, resolved))
    for message in found:
        warnings.warn(message, PlacementWarning, stacklevel=2)
    return replace(resolved, warnings=found)


def _check_rule_target(key: str, captured: CapturedModel, where: str = "rule") -> None:
    walk_name, node_name = split_key(key)
    if walk_name is None:
        if node_name not in captured.graph.components:
            raise _unknown(
                f"{where} {key!r}: unknown component", node_name, captured.graph.components
            )
        return
    if walk_name not in captured.walks:
        raise _unknown(f"{where} {key!r}: unknown walk", walk_name, captured.walks)
    nodes = {n.name: n for n in dataflow.iter_nodes(captured.walks[walk_name].body)}
    components = [name for name, n in nodes.items() if dataflow.is_component(n)]
    node = nodes.get(node_name)
    if node is None:
        raise _unknown(f"{where} {key!r}: walk {walk_name!r} has no node", node_name, components)
    if isinstance(node, ir.LoopNode):
        body = [n.name for n in dataflow.iter_nodes(node.body) if dataflow.is_component(n)]
        raise PlacementError(
            f"{where} {key!r} names a loop; loops are not placed, the nodes of their body are: "
            f"{', '.join(body)}"
        )
    if node.kind == "glue":
        raise PlacementError(
            f"{where} {key!r} names a glue op; glue runs with the component that consumes its "
            f"value, so place that component (component nodes of {walk_name}: "
            f"{', '.join(components)})"
        )


def _unknown(what: str, name: str, known: Sequence[str] | Mapping[str, Any]) -> PlacementError:
    choices = list(known)
    # a loop body node is named "<loop>/<name>": a bare name matching its last part comes first
    same_base = [c for c in choices if c.rpartition("/")[2] == name]
    close = same_base or difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return PlacementError(f"{what} {name!r}{hint} (known: {', '.join(choices)})")


def _place_walk(placement: Placement, walk: ir.Walk) -> dict[str, NodePlacement]:
    ops = [n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.Op)]
    placed = {
        op.name: _place_component(placement, walk.name, op) for op in ops if op.kind == "component"
    }
    flow = ValueFlow(walk)
    first = next(iter(placed.values()), None)
    for op in reversed(ops):  # a glue op's glue readers come after it: place them first
        if op.kind == "glue":
            placed[op.name] = _place_glue(walk.name, op, flow, placed, first)
    return {op.name: placed[op.name] for op in ops}


def _place_component(placement: Placement, walk: str, op: ir.Op) -> NodePlacement:
    rules: tuple[tuple[str, Source], ...] = (
        (f"{walk}:{op.name}", "node_rule"),
        (op.target, "component_rule"),
    )
    for key, source in rules:
        ranks = placement.rules.get(key)
        if ranks is not None:
            tp, replicas = placement.tensor_parallel_of(key), placement.replicas_of(key)
            return NodePlacement(
                walk, op.name, "component", op.target, tuple(ranks), tp, replicas, source, key
            )
    return NodePlacement(walk, op.name, "component", op.target, (0,), 1, 1, "default")


def _place_glue(
    walk: str,
    op: ir.Op,
    flow: ValueFlow,
    placed: Mapping[str, NodePlacement],
    first: NodePlacement | None,
) -> NodePlacement:
    """Glue runs on the ranks of the node it follows, in this order of preference:

    unpacks    the component whose structured output (a tuple) it reads: only tensors travel
    consumer   the first component (walk order) its value reaches
    reader     the glue op reading its value (a glue chain that ends in a walk output)
    producer   the last component (walk order) that reaches its inputs
    walk       the walk's first component
    """
    order = flow.order.__getitem__
    source: Source
    if unpacked := flow.unpacks(op.name):
        follow, source = placed[unpacked[0]], "unpacks"
    elif consumers := flow.consumers(op.name):
        follow, source = placed[min(consumers, key=order)], "consumer"
    elif readers := flow.glue_readers(op.name):
        follow, source = placed[readers[0]], "reader"
    elif producers := flow.producers(op.name):
        follow, source = placed[max(producers, key=order)], "producer"
    elif first is not None:
        follow, source = first, "walk"
    else:
        return NodePlacement(walk, op.name, "glue", op.target, (0,), 1, 1, "default")
    anchor = follow.node if follow.kind == "component" else follow.anchor
    return replace(
        follow, node=op.name, kind="glue", target=op.target, source=source, anchor=anchor
    )


def _check_concurrent_groups(placement: Placement, captured: CapturedModel) -> None:
    """Each ``concurrent`` entry must lie in one Parallel group: otherwise dependencies order
    its nodes and no placement can overlap them."""
    for entry in placement.concurrent:
        walk = split_key(entry[0])[0] or ""
        names = {split_key(key)[1] for key in entry}
        groups = parallel_groups(captured.walk(walk).body)
        if not any(names <= set(group) for group in groups):
            raise PlacementError(
                f"concurrent entry {list(entry)}: these nodes are not branches of one Parallel "
                f"group, so dependencies order them and they can never run concurrently; "
                f"Parallel groups of walk {walk!r}: {groups or 'none'}"
            )


def _concurrency_warnings(placement: Placement, resolved: ResolvedPlacement) -> Iterator[str]:
    """One message per pair of ``concurrent`` nodes whose rank lists overlap."""
    for entry in placement.concurrent:
        for a, b in combinations(entry, 2):
            walk, node_a = split_key(a)
            node_b = split_key(b)[1]
            shared = sorted(
                set(resolved.ranks(walk or "", node_a)) & set(resolved.ranks(walk or "", node_b))
            )
            if shared:
                yield (
                    f"concurrent nodes {a} and {b} are both placed on rank(s) {shared}, so they "
                    f"cannot run concurrently; put them on different ranks or drop the pair "
                    f"from 'concurrent'"
                )
