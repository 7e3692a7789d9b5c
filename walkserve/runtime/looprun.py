"""A simple loop as the loop stepper runs it: the loop compiled once (``SimpleLoop``, by
``LoopCompiler``), one request's run of it (``LoopRun``), and what the stepper reports
(``LoopStreamed`` per commit of a client's stream, ``LoopStreamedRows`` for a cohort's runs at
once, ``LoopDone``, ``LoopFailed``)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from walkserve.capture import dataflow, ir
from walkserve.capture.interpret import Interpreter
from walkserve.lowering.plan import LoopPlan, NodePlan
from walkserve.runtime.loopcohort import CohortSpec, cohort_spec
from walkserve.runtime.loopjoin import Join, joinable
from walkserve.runtime.regionwalk import RegionWalks
from walkserve.runtime.stepvalues import StepBlock
from walkserve.runtime.workitem import LoopStart

if TYPE_CHECKING:
    from walkserve.runtime.loopshare import Band

__all__ = [
    "LoopCompiler",
    "LoopDone",
    "LoopFailed",
    "LoopReport",
    "LoopRun",
    "LoopStreamed",
    "LoopStreamedRows",
    "SimpleLoop",
    "streamed_items",
    "loop_plans",
]


@dataclass(slots=True)
class LoopStreamed:
    item: int
    channel: str
    index: int
    value: Any


@dataclass(slots=True)
class LoopStreamedRows:
    """One cohort step's committed piece of ``channel`` for several runs at once: ``runs``
    holds ``(item, first, offset, rows)``, the ``LoopStreamed`` of run ``item`` being
    iteration ``first + step``, its ``rows`` rows of ``piece`` from ``offset`` along ``dim``
    (``split``). A cohort's steps share one ``runs`` object while its runs stay, so that the
    rank cuts many steps' rows with one call per run (``RankScheduler``), not one per step."""

    channel: str
    dim: int
    runs: tuple[tuple[int, int, int, int], ...]
    step: int
    piece: Any

    def split(self) -> list[LoopStreamed]:
        return [
            LoopStreamed(item, self.channel, first + self.step, self.piece.narrow(self.dim, at, n))
            for item, first, at, n in self.runs
        ]

    def follows(self, other: LoopStreamedRows) -> bool:
        """Whether this is the step after ``other``, of the same runs' rows, of one shape."""
        return (
            self.runs is other.runs
            and self.step == other.step + 1
            and self.dim == other.dim
            and isinstance(self.piece, torch.Tensor)
            and isinstance(other.piece, torch.Tensor)
            and self.piece.shape == other.piece.shape
            and self.piece.dtype == other.piece.dtype
        )


def streamed_items(
    reports: Iterable[LoopStreamed | LoopStreamedRows],
) -> Iterator[tuple[int, str, int, Sequence[Any]]]:
    """``(item, channel, first index, values)`` of streamed loop reports, in each run's
    channel's order: the rows of consecutive steps of one cohort (``LoopStreamedRows.follows``)
    cut with one stack and one cut per run, not one cut per run and step, and left as that
    cut (a ``StepBlock``: not one tensor per step unless read so)."""
    by_channel: dict[str, list[LoopStreamed | LoopStreamedRows]] = {}
    for rep in reports:
        by_channel.setdefault(rep.channel, []).append(rep)
    for reps in by_channel.values():
        k = 0
        while k < len(reps):
            rep = reps[k]
            k += 1
            if isinstance(rep, LoopStreamed):
                yield rep.item, rep.channel, rep.index, (rep.value,)
                continue
            block = [rep]
            while k < len(reps):
                after = reps[k]
                if not isinstance(after, LoopStreamedRows) or not after.follows(block[-1]):
                    break
                block.append(after)
                k += 1
            if len(block) == 1:
                for one in rep.split():
                    yield one.item, one.channel, one.index, (one.value,)
                continue
            joint = torch.stack([b.piece for b in block])  # [steps, ...the piece]
            for item, first, at, n in rep.runs:
                cut = StepBlock(joint.narrow(rep.dim + 1, at, n))
                yield item, rep.channel, first + rep.step, cut


@dataclass(frozen=True)
class LoopDone:
    item: int
    channels: dict[str, Any]


@dataclass(frozen=True)
class LoopFailed:
    item: int
    error: str


LoopReport = LoopStreamed | LoopStreamedRows | LoopDone | LoopFailed


@dataclass(frozen=True)
class SimpleLoop:
    """A simple loop, compiled once: its IR node, its body's plan nodes, where it runs."""

    node: ir.LoopNode
    body: tuple[NodePlan, ...]
    walk: str  # the walk its nodes belong to (the runner's key)
    carried: tuple[tuple[str, int], ...]  # (param, body output index)
    affine: tuple[tuple[str, int, int], ...]  # (param, start, step)
    select: tuple[tuple[str, int, int, int], ...]  # (param, dim, start, step)
    table: tuple[str, ...]
    ops: dict[str, ir.Op]  # the body's ops by name
    calls: dict[str, Any]  # component node -> (args, kwargs) getters from the body's values
    join: Join | None  # how runs at its one body node share a call (None: they do not)
    cohort: CohortSpec | None  # how its runs keep one joint state (None: they do not)


@dataclass(eq=False)
class LoopRun:
    item: int
    request: str  # the item's request (in the rank's conductor)
    loop: SimpleLoop
    start: LoopStart
    env: dict[str, Any] = field(default_factory=dict)
    carried: dict[str, Any] = field(default_factory=dict)
    collected: dict[str, list[Any]] = field(default_factory=dict)
    last: list[Any] | None = None
    i: int = 0
    pos: int = 0  # the body node it waits at
    alone: bool = False  # its last joined call raised: it takes this node by itself
    band: Band | None = None  # the cohort it steps in
    solo: bool = False  # a cohort could not hold it: it joins calls step by step


def loop_plans(regions: RegionWalks) -> dict[tuple[str, str], tuple[ir.LoopNode, LoopPlan]]:
    """Every loop of the region walks, by (region walk, loop name), with its body plan."""
    out: dict[tuple[str, str], tuple[ir.LoopNode, LoopPlan]] = {}
    for name, walk in regions.captured.graph.walks.items():
        loops = {n.name: n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.LoopNode)}

        def visit(block: Any) -> None:
            for item in block.nodes:
                if isinstance(item, LoopPlan):
                    out[(name, item.name)] = (loops[item.name], item)  # noqa: B023
                    visit(item.body)

        visit(regions.plan.walks[name])
    return out


class LoopCompiler:
    """Compiles the simple loops of a rank's region walks, each once."""

    def __init__(
        self, regions: RegionWalks, joins: Collection[tuple[str, str]], cohorts: bool
    ) -> None:
        self.regions = regions
        self.joins = frozenset(joins)
        self.cohorts = cohorts
        self.interp = Interpreter(regions.captured)
        self._plans = loop_plans(regions)
        self._loops: dict[tuple[str, str], SimpleLoop] = {}

    def compile(self, walk: str, name: str) -> SimpleLoop:
        """Loop ``name`` of region walk ``walk``, compiled the first time it is asked for."""
        key = (walk, name)
        loop = self._loops.get(key)
        if loop is None:
            node, plan = self._plans[key]
            body = tuple(n for n in plan.body.nodes if isinstance(n, NodePlan))
            affine, select, table, carried = [], [], [], []
            for p in node.params:
                role = p.role
                if isinstance(role, ir.Carried):
                    carried.append((p.name, role.output))
                elif isinstance(role, ir.PerStep):
                    src = role.source
                    if isinstance(src, ir.AffineStep):
                        affine.append((p.name, src.start, src.step))
                    elif isinstance(src, ir.SelectStep):
                        select.append((p.name, src.dim, src.start, src.step))
                    elif isinstance(src, ir.TableStep):
                        table.append(p.name)
            loop = self._loops[key] = SimpleLoop(
                node,
                body,
                self.regions.walk_of.get(walk, walk),
                tuple(carried),
                tuple(affine),
                tuple(select),
                tuple(table),
                ops := {n.name: n for n in dataflow.iter_nodes(node.body) if isinstance(n, ir.Op)},
                {
                    n.name: (
                        [self._getter(a) for a in ops[n.ops[0]].args],
                        [(k, self._getter(a)) for k, a in ops[n.ops[0]].kwargs.items()],
                    )
                    for n in body
                    if n.kind == "component"
                },
                join := joinable(
                    body, ops, (self.regions.walk_of.get(walk, walk), node.name), self.joins
                ),
                cohort_spec(node, body, ops, join) if self.cohorts else None,
            )
        return loop

    def _getter(self, arg: ir.Arg) -> Any:
        """A function of the body's values giving ``arg`` (a plain lookup for a value)."""
        if isinstance(arg, ir.Ref):
            name = arg.name
            return lambda env: env[name]
        value = self.interp.value
        return lambda env: value(arg, env)
