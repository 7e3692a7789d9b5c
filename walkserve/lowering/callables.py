"""The plan's component nodes as batched callables (``batched.BatchedComponent``), by
``"<walk>:<node>"``: what a rank's runner calls. A node the plan records as CUDA graphs
(``CompilePlan.cuda_graph``: lowered for CUDA, capturable) gets a ``cudagraph.GraphOnFirstCall``,
recorded per batch bucket at its first call on a CUDA device; every other node, and every node
of a CPU plan, the plain callable.
"""

from __future__ import annotations

from torch import nn

from walkserve.capture.model import CapturedModel
from walkserve.lowering.batched import BatchedComponent, BatchStats
from walkserve.lowering.plan import ExecutablePlan

__all__ = ["build_callables"]


def build_callables(
    captured: CapturedModel,
    plan: ExecutablePlan,
    rank: int | None = None,
    *,
    pad_to_buckets: bool = False,
    stats: BatchStats | None = None,
) -> dict[str, BatchedComponent]:
    """The component nodes of ``plan`` (those on ``rank``, or all) as batched callables, by
    ``"<walk>:<node>"``."""
    out: dict[str, BatchedComponent] = {}
    for walk in plan.walks:
        for node in plan.nodes(walk):
            if node.kind != "component" or (rank is not None and rank not in node.ranks):
                continue
            module: nn.Module = captured.model.get_submodule(node.target)
            args = (node.name, module, node.in_dims, node.kw_dims, node.out_dim)
            if node.compile.cuda_graph and not hasattr(module, "forward_batch"):
                from walkserve.lowering.cudagraph import GraphOnFirstCall

                out[f"{walk}:{node.name}"] = GraphOnFirstCall(
                    *args, graph_buckets=node.batch_buckets, stats=stats
                )
                continue
            out[f"{walk}:{node.name}"] = BatchedComponent(
                *args, node.batch_buckets if pad_to_buckets else (), stats
            )
    return out
