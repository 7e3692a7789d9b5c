"""``lower(captured, sample_inputs, placement)``: the lowering passes, in order.

    analyze      batch dimension of every value (batchdims), sample arguments per op
    split        IR blocks -> plan blocks of dispatch units, glue grouped by policy (split)
    annotate     per component node: argument/result batch dims, batch buckets, compile plan
    place        ranks per node (a tensor-parallel group's leader for the group), the TP
                 groups, and memory per rank from the placement (placement)
    regions      the runs of items each rank executes by itself (regions)

Each pass takes its policy as a parameter; the result is an ``ExecutablePlan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from walkserve.capture import dataflow, ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.batchdims import BatchAnalysis, analyze
from walkserve.lowering.compile import check_capturable, compile_plan
from walkserve.lowering.memory import MemoryLimits, estimate_memory
from walkserve.lowering.placement import Placement
from walkserve.lowering.plan import (
    BlockPlan,
    ExecutablePlan,
    MemoryLine,
    NodePlan,
    RankPlan,
    TPGroupPlan,
)
from walkserve.lowering.regions import conductor_values, find_regions
from walkserve.lowering.resolved import resolve
from walkserve.lowering.split import POLICIES, GluePolicy, split_block
from walkserve.lowering.valueflow import node_io, reader_ranks, value_readers


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (the sizes CUDA graphs are recorded
    for; a batch runs in the smallest bucket that holds it)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [b for b in (1, 2, 4) if b <= max_batch]
    buckets += list(range(8, max_batch + 1, 8))
    if buckets[-1] != max_batch:
        buckets.append(max_batch)
    return buckets


def lower(
    captured: CapturedModel,
    sample_inputs: Mapping[str, Any],
    placement: Placement | None = None,
    *,
    device: str = "cpu",
    glue: str | GluePolicy = "fuse",
    max_batch: int = 32,
    check_capture: bool = True,
    limits: MemoryLimits | None = None,
    regions: bool = True,
) -> ExecutablePlan:
    """``regions=False``: no region is handed to a rank (the conductor drives every node:
    the plan of the previous execution model, kept for tests of the conductor itself)."""
    policy: GluePolicy = POLICIES[glue] if isinstance(glue, str) else glue
    analysis = analyze(captured, sample_inputs)
    walks: dict[str, BlockPlan] = {}
    for name, walk in captured.graph.walks.items():
        block = split_block(walk.body, policy)
        ops = {n.name: n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.Op)}
        _annotate(
            block, ops, analysis, name, captured, device, batch_buckets(max_batch), check_capture
        )
        readers = value_readers(walk)
        for node in _nodes(block):
            node.inputs, node.outputs = node_io(ops, node.ops, readers)
        walks[name] = block
    plan = ExecutablePlan(
        model=captured.graph.model,
        device=device,
        walks=walks,
        ranks={},
        glue_policy=glue if isinstance(glue, str) else getattr(glue, "__name__", "custom"),
        max_batch=max_batch,
    )
    _place(plan, captured, placement, limits)
    if regions:
        plan.regions = {
            name: found
            for name, walk in captured.graph.walks.items()
            if (found := find_regions(walk, plan.walks[name]))
        }
    plan.conductor_values = {
        name: conductor_values(walk, plan.regions.get(name, []))
        for name, walk in captured.graph.walks.items()
    }
    plan.readers = {
        name: reader_ranks(walk, plan.nodes(name)) for name, walk in captured.graph.walks.items()
    }
    return plan


def _annotate(
    block: BlockPlan,
    ops: dict[str, ir.Op],
    analysis: BatchAnalysis,
    walk: str,
    captured: CapturedModel,
    device: str,
    buckets: list[int],
    check: bool,
) -> None:
    dims = analysis.dims[walk]
    samples = analysis.samples[walk]

    def dim_of(arg: ir.Arg) -> Any:
        return _jsonable(dims.get(arg.name)) if isinstance(arg, ir.Ref) else None

    for node in block.nodes:
        if not isinstance(node, NodePlan):
            _annotate(node.body, ops, analysis, walk, captured, device, buckets, check)
            continue
        if node.kind != "component":
            continue
        op = ops[node.ops[0]]
        node.in_dims = [dim_of(a) for a in op.args]
        node.kw_dims = {k: dim_of(a) for k, a in op.kwargs.items()}
        node.out_dim = _jsonable(dims.get(op.name))
        node.batch_buckets = buckets
        capturable: bool | None = None
        reason: str | None = None
        if check and op.name in samples:
            args, kwargs = samples[op.name]
            capturable, reason = check_capturable(
                captured.model.get_submodule(op.target), args, kwargs
            )
        node.compile = compile_plan(device, capturable, reason)


def _nodes(block: BlockPlan) -> list[NodePlan]:
    return [
        n
        for item in block.nodes
        for n in ([item] if isinstance(item, NodePlan) else _nodes(item.body))
    ]


def _jsonable(dim: Any) -> Any:
    if isinstance(dim, tuple):
        return [_jsonable(d) for d in dim]
    return dim


def _place(
    plan: ExecutablePlan,
    captured: CapturedModel,
    placement: Placement | None,
    limits: MemoryLimits | None,
) -> None:
    """Ranks per node (everything on rank 0 without a placement) and memory per rank."""
    resolved = resolve(placement or Placement.default(1), captured)
    estimates = estimate_memory(resolved, captured, limits)
    ranks = {
        r: RankPlan([], MemoryLine(e.weights, e.kv_pool, e.stream_buffers, e.workspace))
        for r, e in estimates.items()
    }
    groups = (placement or Placement.default(1)).tp_groups()
    members = {rank: group for group in groups for rank in group}
    components: dict[tuple[int, ...], list[str]] = {group: [] for group in groups}
    for walk in plan.walks:
        for node in plan.nodes(walk):
            placed = resolved.node(walk, node.ops[0])
            for r in placed.ranks:
                ranks[r].nodes.append(f"{walk}:{node.name}")
            # a tensor-parallel group is dispatched to through its leader alone
            node.ranks = sorted(placed.ranks[:: placed.tensor_parallel])
            if placed.tensor_parallel == 1 or node.kind != "component":
                continue
            for leader in node.ranks:
                group = members[leader]
                if node.target not in components[group]:
                    components[group].append(node.target)
    plan.ranks = ranks
    plan.tp_groups = [TPGroupPlan(list(g), components[g]) for g in groups if components[g]]
