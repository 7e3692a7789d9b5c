"""The executable plan: what lowering produces and every worker builds its part from.

Serializable without pickle (msgspec JSON), versioned, printable. It holds structure and
policy, never weights: a worker rebuilds the callables of the nodes placed on its rank from the
captured model (``build.callables``) and this plan.

    ExecutablePlan
      walks: {walk: BlockPlan}
        BlockPlan.nodes: NodePlan | LoopPlan         (in execution order)
          NodePlan   one dispatch: a component op (batched) + fused glue, or a glue group
          LoopPlan   a loop of the IR; its body is a BlockPlan
      regions: {walk: [RegionPlan]}  runs of items one rank executes by itself
      ranks: {rank: RankPlan}  node names and the memory estimate per rank
      tp_groups: [TPGroupPlan]  ranks that run components as one tensor-parallel group
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PLAN_VERSION = 2


class CompilePlan(msgspec.Struct, frozen=True):
    """How a node is accelerated. ``torch_compile`` defaults off on CPU (no measured gain on
    small models there) and on on CUDA; ``cuda_graph`` records one graph per batch bucket on
    CUDA for nodes ``capturable`` under ``torch.compile(fullgraph=True)`` (checked on CPU too).
    ``reason`` says why a node is not capturable."""

    torch_compile: bool = False
    cuda_graph: bool = False
    capturable: bool | None = None
    reason: str | None = None


class NodePlan(msgspec.Struct, tag="node"):
    """One dispatch unit. ``ops`` are the IR op names it runs in order: for a component node
    the component op first, then the glue fused into it; for a glue node its glue ops.
    ``in_dims``/``kw_dims``/``out_dim``: batch dimension of each argument and of the result of
    the component op (an int, None, or a nested list for tuples). ``inputs``: the values its
    ops read that it does not make; ``outputs``: the values it makes that something outside it
    reads (later ops, loop plumbing, the walk's outputs, a stream): computed once, by lowering,
    for everyone who moves a node's values."""

    name: str
    kind: Literal["component", "glue"]
    ops: list[str]
    target: str
    ranks: list[int] = msgspec.field(default_factory=lambda: [0])
    in_dims: list[Any] = []
    kw_dims: dict[str, Any] = {}
    out_dim: Any = None
    batch_buckets: list[int] = []
    compile: CompilePlan = CompilePlan()
    inputs: list[str] = []
    outputs: list[str] = []


class LoopPlan(msgspec.Struct, tag="loop"):
    name: str
    body: BlockPlan


class BlockPlan(msgspec.Struct):
    nodes: list[NodePlan | LoopPlan]


class RegionPlan(msgspec.Struct, frozen=True):
    """Consecutive items of one block that rank ``rank`` runs by itself for a request
    (``lowering.regions``): it is handed the region once and reports at its exit. With
    ``replicas``, each of them can, and the batcher picks one per request.

    ``path``: the loops enclosing the block, outer to inner (``[]``: the walk body); ``items``:
    the block's plan items (node and loop names) it covers, in order; ``inputs``: values it
    reads from outside; ``trip_inputs``: walk inputs its loops' trip counts and ``max_iters``
    name; ``outputs``: values it makes that are read after it (by the block, the enclosing
    loop's plumbing or the walk's outputs); ``streamed``: accumulated channels of its loops
    that are client outputs of the walk, reported as each iteration commits; ``forwards``:
    accumulated channels of its loops that stream into another region (each committed item
    is sent on as it commits, as far as the consumer's credit allows); ``fed``: the streams
    (edge names) its loops consume whose items come from another region; ``feeds``: the
    streams (edge names) from its loops into loops the conductor drives (their sources among
    ``forwards``: the conductor takes each committed item into its own buffer)."""

    name: str
    rank: int
    path: list[str]
    items: list[str]
    inputs: list[str]
    outputs: list[str]
    trip_inputs: list[str] = []
    streamed: list[str] = []
    forwards: list[str] = []
    fed: list[str] = []
    replicas: list[int] = []  # ranks that each run it (``rank`` the first); empty: ``rank``
    feeds: list[str] = []

    @property
    def ranks(self) -> list[int]:
        return self.replicas or [self.rank]


class MemoryLine(msgspec.Struct, frozen=True):
    weights: int = 0
    kv: int = 0
    streams: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.streams + self.workspace


class TPGroupPlan(msgspec.Struct, frozen=True):
    """A tensor-parallel group (``Placement.tp_groups``): its worker ranks, leader first, and
    the components (paths) it runs sharded. Only the leader is in its nodes' ``ranks``: work
    is dispatched to it, and it runs each batch with the others in lockstep (``runtime.tp``)."""

    ranks: list[int]
    components: list[str]


class RankPlan(msgspec.Struct):
    nodes: list[str]
    memory: MemoryLine = MemoryLine()


class ExecutablePlan(msgspec.Struct):
    model: str
    device: str
    walks: dict[str, BlockPlan]
    ranks: dict[int, RankPlan]
    regions: dict[str, list[RegionPlan]] = {}
    # per walk: values whose bytes the conductor's process needs (``regions.conductor_values``);
    # every other value stays on the rank that made it
    conductor_values: dict[str, list[str]] = {}
    # per walk: the ranks that may read each value (``valueflow.reader_ranks``; absent: any
    # rank may), so that a rank exports a value it holds only for readers on other hosts
    readers: dict[str, dict[str, list[int]]] = {}
    glue_policy: str = "fuse"
    max_batch: int = 32
    tp_groups: list[TPGroupPlan] = []
    version: int = PLAN_VERSION

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def from_json(text: str | bytes) -> ExecutablePlan:
        plan = msgspec.json.decode(text, type=ExecutablePlan)
        if plan.version != PLAN_VERSION:
            raise ValueError(
                f"plan version {plan.version} is not supported (expected {PLAN_VERSION})"
            )
        return plan

    def nodes(self, walk: str) -> list[NodePlan]:
        """Every node of a walk, loop bodies included, in execution order."""
        out: list[NodePlan] = []

        def visit(block: BlockPlan) -> None:
            for n in block.nodes:
                if isinstance(n, NodePlan):
                    out.append(n)
                else:
                    visit(n.body)

        visit(self.walks[walk])
        return out

    def format(self) -> str:
        """Per-rank node list and memory estimate, for people."""
        lines = [
            f"plan for {self.model} on {self.device} (glue: {self.glue_policy}, max batch {self.max_batch})"
        ]
        for walk in self.walks:
            lines.append(f"walk {walk}:")
            for node in self.nodes(walk):
                comp = node.compile
                flags = (
                    [f"ranks {node.ranks}", f"buckets {node.batch_buckets}"]
                    if node.kind == "component"
                    else [f"ranks {node.ranks}"]
                )
                if node.kind == "component":
                    flags.append(
                        "graph-capturable"
                        if comp.capturable
                        else f"not capturable ({comp.reason})"
                        if comp.capturable is False
                        else "capture unchecked"
                    )
                    if comp.torch_compile:  # planned; the runtime does not apply it yet
                        flags.append("torch.compile planned, not applied")
                    if comp.cuda_graph:
                        flags.append("cuda graphs")
                lines.append(f"  {node.kind:9} {node.name:32} {'; '.join(flags)}")
            for region in self.regions.get(walk, []):
                where = f" in loop {'/'.join(region.path)}" if region.path else ""
                on = f"rank {region.rank}" if not region.replicas else f"ranks {region.replicas}"
                feeds = (
                    f"; streams {', '.join(region.feeds)} to the conductor" if region.feeds else ""
                )
                lines.append(
                    f"  region    {region.name:32} {on}{where}: "
                    f"{', '.join(region.items)} (runs there by itself{feeds})"
                )
        for group in self.tp_groups:
            lines.append(
                f"tensor-parallel group ranks {group.ranks} (leader {group.ranks[0]}): "
                f"{', '.join(group.components)}"
            )
        lines.append("ranks:")
        for rank, rp in sorted(self.ranks.items()):
            m = rp.memory
            lines.append(
                f"  rank {rank}: {len(rp.nodes)} nodes; memory weights {_mib(m.weights)}, KV {_mib(m.kv)}, "
                f"streams {_mib(m.streams)}, workspace {_mib(m.workspace)}, total {_mib(m.total)}"
            )
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
