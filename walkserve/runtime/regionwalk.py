"""Region walks: every ``RegionPlan`` as a walk of its own, which its rank's scheduler runs.

A region (``lowering.regions``) is a run of items of one block of a walk. Its rank runs it with
the same state machine the conductor runs whole walks with (``Conductor``), over a walk made
from the region::

    walk decode(token, cache, count, max_new_tokens, ...)     region r0 = [step]
      loop step ...                                        ->  walk decode@region0(token, cache,
      return tokens = step.token.all                            count, max_new_tokens, ...)
                                                                 loop step ...      (the same node)
                                                                 return step.token.all = ...

Its inputs are the region's inputs and the walk inputs its loops' bounds name; its outputs are
the region's outputs under their own names; its streams are the walk's streams between loops
inside it. Nodes keep their names, so a region walk's node is the original walk's node (the
runner's callables are keyed by the original walk: ``RegionWalks.walk_of``). No transitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from walkserve.capture import dataflow, ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.plan import BlockPlan, ExecutablePlan, LoopPlan, NodePlan, RegionPlan

__all__ = ["RegionWalks", "region_walk_name", "region_walks"]


def region_walk_name(walk: str, region: str) -> str:
    """``walk@region``: walk names never hold ``@`` (they are Python identifiers)."""
    return f"{walk}@{region}"


@dataclass(frozen=True)
class RegionWalks:
    """The region walks of a plan (of one rank, or all): ``captured`` and ``plan`` hold them
    as walks over the same model; ``walk_of`` and ``regions`` map a region walk back to its
    walk and its ``RegionPlan``."""

    captured: CapturedModel
    plan: ExecutablePlan
    walk_of: dict[str, str]
    regions: dict[str, RegionPlan]


def region_walks(captured: CapturedModel, plan: ExecutablePlan, rank: int | None) -> RegionWalks:
    """The walks of the regions placed on ``rank`` (None: every rank's)."""
    walks: dict[str, ir.Walk] = {}
    blocks: dict[str, BlockPlan] = {}
    walk_of: dict[str, str] = {}
    regions: dict[str, RegionPlan] = {}
    for walk_name, found in plan.regions.items():
        walk = captured.graph.walks[walk_name]
        for region in found:
            if rank is not None and rank not in region.ranks:
                continue
            name = region_walk_name(walk_name, region.name)
            walks[name], blocks[name] = _region_walk(walk, plan.walks[walk_name], region, name)
            walk_of[name], regions[name] = walk_name, region
    graph = msgspec.structs.replace(captured.graph, walks=walks, custom_transition=False)
    inner = CapturedModel(graph, captured.model)
    inner.origin = captured.origin
    inner_plan = msgspec.structs.replace(plan, walks=blocks, regions={})
    return RegionWalks(inner, inner_plan, walk_of, regions)


def _region_walk(
    walk: ir.Walk, top: BlockPlan, region: RegionPlan, name: str
) -> tuple[ir.Walk, BlockPlan]:
    body, plan = walk.body, top
    for loop_name in region.path:  # down to the region's block
        node = next(n for n in body.nodes if isinstance(n, ir.LoopNode) and n.name == loop_name)
        loop = next(i for i in plan.nodes if isinstance(i, LoopPlan) and i.name == loop_name)
        body, plan = node.body, loop.body
    items = [i for i in plan.nodes if i.name in region.items]
    names: set[str] = set()
    for item in items:
        names |= set(item.ops) if isinstance(item, NodePlan) else {item.name}
    nodes = [n for n in body.nodes if n.name in names]
    loops = {n.name for n in dataflow.iter_nodes(ir.Block([], nodes)) if isinstance(n, ir.LoopNode)}
    inputs = [ir.WalkInput(v, walk.values.get(v)) for v in [*region.inputs, *region.trip_inputs]]
    inner = ir.Walk(
        name=name,
        inputs=inputs,
        body=ir.Block([], nodes),
        # forwarded channels are outputs too: the walk's loops stream them item by item
        outputs={v: ir.Ref(v) for v in dict.fromkeys([*region.outputs, *region.forwards])},
        streams=[e for e in walk.streams if e.consumer in loops],
        values=walk.values,
        source=walk.source,
    )
    return inner, BlockPlan(items)
