"""The split pass: IR blocks -> plan blocks of dispatch units, with glue grouped by policy.

A ``GluePolicy`` decides, per glue op, whether it may be fused into the component node that
precedes it (run right after the component, per request, in the same dispatch). Glue that is
not fused is grouped: consecutive unfused glue ops form one stateless glue node.

    policy "fuse" (default): indexing and elementwise ops fuse into the preceding component
    policy "separate":       every run of consecutive glue ops is one glue node
    a callable:              your own rule, (op) -> bool

    block:  lm, getitem, getitem_1, argmax, eq, all, ...   ("fuse")
    plan:   [component lm: lm, getitem, getitem_1, argmax, eq]  [glue: all] ...

Only consecutive ops are grouped, so a node reads nothing produced after it in block order.
"""

from __future__ import annotations

from collections.abc import Callable

from walkserve.capture import ir
from walkserve.lowering.plan import BlockPlan, LoopPlan, NodePlan

GluePolicy = Callable[[ir.Op], bool]

# Glue that is cheap (per element, an index, a small reduction or a concatenation of a
# request's own values): worth running inside the component's dispatch rather than paying a
# round trip of its own. A loop's stop predicate (``x.all()``) is one of these: fused, a decode
# step costs one dispatch instead of two.
FUSIBLE = {
    "function:operator.getitem",
    "function:operator.add",
    "function:operator.sub",
    "function:operator.mul",
    "function:operator.truediv",
    "function:operator.neg",
    "function:operator.eq",
    "function:operator.ne",
    "function:operator.gt",
    "function:operator.lt",
    "function:operator.ge",
    "function:operator.le",
    "function:operator.and_",
    "function:operator.or_",
    "function:builtins.getattr",
    "function:operator.invert",
    "function:torch.tanh",
    "function:torch.cat",
    "function:torch.stack",
    "function:torch.where",
    "function:torch.full_like",
    "function:torch.ones_like",
    "function:torch.zeros_like",
    "function:torch.sigmoid",
    "method:argmax",
    "method:all",
    "method:any",
    "method:masked_fill",
    "method:clamp",
    "method:clamp_min",
    "method:clamp_max",
    "method:float",
    "method:to",
    "method:view",
    "method:t",
    "method:transpose",
    "method:permute",
    "method:expand",
    "method:repeat",
    "method:contiguous",
    "method:flatten",
    "method:reshape",
    "method:squeeze",
    "method:unsqueeze",
}


def fuse_elementwise(op: ir.Op) -> bool:
    return op.target in FUSIBLE


def separate(op: ir.Op) -> bool:
    return False


POLICIES: dict[str, GluePolicy] = {"fuse": fuse_elementwise, "separate": separate}


def split_block(block: ir.Block, policy: GluePolicy) -> BlockPlan:
    """Group ``block``'s ops into dispatch units; loops keep their place, bodies split too."""
    nodes: list[NodePlan | LoopPlan] = []
    current: NodePlan | None = None  # the node that following glue may still join
    for node in block.nodes:
        if isinstance(node, ir.LoopNode):
            current = None
            nodes.append(LoopPlan(node.name, split_block(node.body, policy)))
        elif node.kind == "component":
            current = NodePlan(node.name, "component", [node.name], node.target)
            nodes.append(current)
        elif current is not None and (current.kind == "glue" or policy(node)):
            current.ops.append(node.name)
        else:
            current = NodePlan(node.name, "glue", [node.name], "glue")
            nodes.append(current)
    return BlockPlan(nodes)
