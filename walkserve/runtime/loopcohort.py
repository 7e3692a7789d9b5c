"""Cohorts: runs of a joined loop that keep their state as one batch between steps.

A joined step (``loopjoin``) still does per-run work on every step: each run's call is built
from its own values, keyed, concatenated, and the outputs split back. A *cohort* does that
once: the runs' carried values, invariant arguments and per-step slices are concatenated along
their batch dimensions when it forms, every step calls the component on those joint values and
keeps the joint outputs as the next step's carried values, and each run's rows are cut out only
when the cohort dissolves (vLLM's persistent batch, for a captured loop)::

    spec = cohort_spec(node, body, ops, join)     # None: this loop does not keep cohorts
    cohort = form(spec, [Member(start, i, carried, rows), ...])  # None: one of them cannot
    call = cohort.call()                          # this step's joint arguments
    ok = cohort.advance(values)                   # False: values not batched as captured
    states = cohort.dissolve()                    # per run: carried, last, pieces, steps
    joined = extend(cohort, [Member(...), ...])   # newcomers after its runs (None: cannot)
    rest = shrink(cohort, keep, [Member(...), ...])  # at its length: the runs that go on
    pieces = cohort.seal()                        # per run: its pieces so far

A cohort lives for at most ``length`` steps: the fewest iterations any of its runs has left
(its bound, or the last index its per-step slices reach). Then the runs with iterations left go
on in a cohort of their rows (``shrink``) and only the others leave. It dissolves when a run of
it is cancelled, when its call raises, and where no such cohort can be made; after dissolving,
each run goes on as the loop stepper's own (its commit rules, its failure rule). A new run of
the loop whose call shares the cohort's join key joins it between two steps (``extend``): its
values are concatenated after the cohort's, with no per-run cut of the runs already in it (they
keep the steps they took so far as their pieces, ``seal``, and go on from there), so that
requests arriving one by one do not re-form the cohort each time.

A loop keeps cohorts when its one body node is joinable, every argument of its component is a
constant or a parameter (invariant, carried or a per-step slice: no iteration index, no table),
its outputs are values of that node with a batch dimension where they are carried, and it has
no stop predicate (a stop is read per run at every commit). A run whose stream another rank
reads with credit (backpressure, checked per run per step) steps outside cohorts; a client's
stream gets each commit's rows as the step ends. Semantics are the stepper's: a run's iterations, carried values,
accumulated pieces and last outputs are the rows of the joint ones that hold it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.loopsem import Steps
from walkserve.lowering.plan import NodePlan
from walkserve.runtime.loopjoin import Join
from walkserve.runtime.workitem import LoopStart

__all__ = [
    "ARG_CARRIED",
    "ARG_CONST",
    "ARG_FIXED",
    "ARG_STEP",
    "Cohort",
    "CohortSpec",
    "Member",
    "cohort_spec",
    "extend",
    "form",
    "shrink",
]

# An argument of the component: ("const", value) or ("param", name).
_Arg = tuple[str, Any]
# where an argument's value comes from at each step (``CohortSpec.plan``): itself (a constant),
# the carried values, this step's slices or the invariant values (``Cohort.call``)
ARG_CONST, ARG_CARRIED, ARG_STEP, ARG_FIXED = 0, 1, 2, 3
VIEWS = 32  # per-step slices cut at a time (``Cohort.call``)


@dataclass(frozen=True)
class CohortSpec:
    """How a loop's runs join as a cohort: the component's arguments, the batch dimension of
    each parameter they read, and where the loop's outputs and channels come from."""

    args: tuple[_Arg, ...]
    kwargs: tuple[tuple[str, _Arg], ...]
    param_dims: dict[str, int | None]  # the batch dim of each parameter an argument reads
    carried: tuple[tuple[str, int], ...]  # (param, loop output index)
    select: dict[str, tuple[int, int, int]]  # param -> (dim, start, step)
    outputs: tuple[str, ...]  # the loop's outputs (values of the body node)
    out_dims: dict[str, int | None]  # batch dim of each value the body node makes
    accumulated: dict[str, int]  # channel -> loop output index

    @functools.cached_property
    def batched(self) -> tuple[tuple[str, int], ...]:
        """(value, batch dim) of the body node's batched values."""
        return tuple((n, d) for n, d in self.out_dims.items() if d is not None)

    @functools.cached_property
    def plan(self) -> tuple[tuple[tuple[int, Any], ...], tuple[tuple[str, int, Any], ...]]:
        """Where each argument of the call comes from, resolved once (``Cohort.call``): (kind,
        value or parameter) per positional argument, (name, kind, ...) per keyword one."""

        def where(arg: _Arg) -> tuple[int, Any]:
            kind, v = arg
            if kind == "const":
                return ARG_CONST, v
            if v in self.carried_dims:
                return ARG_CARRIED, v
            if v in self.select:
                return ARG_STEP, v
            return ARG_FIXED, v

        return (
            tuple(where(a) for a in self.args),
            tuple((name, *where(a)) for name, a in self.kwargs),
        )

    @functools.cached_property
    def carried_dims(self) -> dict[str, int | None]:
        """The batch dim of each carried parameter: that of the output it takes its next
        value from (``cohort_spec`` checked it is the parameter's own where it reads one)."""
        return {p: self.out_dims[self.outputs[k]] for p, k in self.carried}

    @functools.cached_property
    def fixed_dims(self) -> dict[str, int | None]:
        """The batch dim of each invariant parameter (neither carried nor a per-step slice)."""
        return {
            p: d
            for p, d in self.param_dims.items()
            if p not in self.select and p not in self.carried_dims
        }


@dataclass(frozen=True)
class Member:
    """A run as it joins: its start values, its iteration, its carried values, its rows."""

    start: LoopStart
    i: int
    carried: Mapping[str, Any]
    rows: int


@dataclass(frozen=True)
class Left:
    """A run's state when its cohort dissolves: what it carries into its next iteration, its
    last outputs, its accumulated pieces (by channel, in step order; the steps a cohort of
    several runs took are one ``Steps``) and the steps it took."""

    carried: dict[str, Any]
    last: list[Any] | None
    pieces: dict[str, list[Any]]
    steps: int


@dataclass(eq=False)
class Cohort:
    spec: CohortSpec
    rows: list[int]
    length: int  # steps it may take
    fixed: dict[str, Any]  # invariant parameters, joint
    carried: dict[str, Any]  # carried parameters, joint
    slabs: dict[str, torch.Tensor]  # per-step parameters: [.., length at dim, ..], joint
    steps: int = 0
    offsets: list[int] = field(default_factory=list)  # each run's first row
    total: int = 0  # rows of every run
    last: list[Any] | None = None
    pieces: dict[str, list[Any]] = field(default_factory=dict)
    # runs (the first ``rebased``) that an ``extend`` took in from an earlier cohort: their
    # carried values are the joint ones even before this cohort's first step
    rebased: int = 0
    # the per-step slices' views of steps ``_views_at`` on (``VIEWS`` at a time, made as the
    # steps reach them: a cohort that an ``extend`` or ``shrink`` replaces after a few steps
    # of a long loop made a few views, not one per step of its length)
    _views: dict[str, Sequence[torch.Tensor]] = field(default_factory=dict)
    _views_at: int = 0

    def call(self) -> tuple[list[Any], dict[str, Any]]:
        """This step's arguments: every run's rows, concatenated."""
        # each kind's values by name (``ARG_CARRIED``, ``ARG_STEP``, ``ARG_FIXED``)
        views, j = self.views(self.steps) if self.slabs else ({}, 0)
        now = {p: v[j] for p, v in views.items()}
        at: tuple[Mapping[str, Any], ...] = ({}, self.carried, now, self.fixed)
        args, kwargs = self.spec.plan
        return [at[k][v] if k else v for k, v in args], {
            name: at[k][v] if k else v for name, k, v in kwargs
        }

    def views(self, i: int) -> tuple[Mapping[str, Sequence[torch.Tensor]], int]:
        """The per-step slices' views that hold step ``i`` (each parameter's, cut ``VIEWS`` at
        a time as the steps reach them), and step ``i``'s index in them."""
        views, j = self._views, i - self._views_at
        if not 0 <= j < len(next(iter(views.values()), ())):
            select, n = self.spec.select, min(VIEWS, self.length - i)
            views = self._views = {
                p: _narrow(slab, select[p][0], i, n).unbind(select[p][0])
                for p, slab in self.slabs.items()
            }
            self._views_at, j = i, 0
        return views, j

    def outputs(self, values: Mapping[str, Any]) -> list[Any] | None:
        """A step's joint values as the loop's outputs, in order; None where a batched value
        does not hold every run's rows (as ``Join.split`` refuses it) or an output is missing."""
        total = self.total
        for name, dim in self.spec.batched:
            v = values.get(name)
            if v is None:
                continue
            if not isinstance(v, torch.Tensor) or v.dim() <= dim or v.shape[dim] != total:
                return None
        try:
            return [values[o] for o in self.spec.outputs]
        except KeyError:
            return None

    def advance(self, values: Mapping[str, Any]) -> bool:
        """Commit a step's joint values; False (nothing committed) where ``outputs`` refuses
        them."""
        spec, outs = self.spec, self.outputs(values)
        if outs is None:
            return False
        for ch, k in spec.accumulated.items():
            self.pieces.setdefault(ch, []).append(outs[k])
        self.carried = {p: outs[k] for p, k in spec.carried}
        self.last = outs
        self.steps += 1
        return True

    def piece(self, channel: str, k: int) -> Any:
        """Run ``k``'s rows of the last step's piece of accumulated ``channel`` (None if it
        has none)."""
        pieces = self.pieces.get(channel)
        if not pieces:
            return None
        out = self.spec.outputs[self.spec.accumulated[channel]]
        dim = self.spec.out_dims[out]
        if dim is None or len(self.rows) == 1:  # one run holds every row
            return pieces[-1]
        return pieces[-1].narrow(dim, self.offsets[k], self.rows[k])  # a part: never whole

    def done(self) -> bool:
        return self.steps >= self.length

    def held(self) -> int:
        return len(self.carried) + len(self.fixed) + sum(len(v) for v in self.pieces.values())

    def dissolve(self) -> list[Left]:
        """Each run's rows of the cohort's state, in the order the runs joined (a run taken
        in by ``extend`` that has taken no step here: its carried rows, no last outputs)."""
        spec, sealed = self.spec, self.seal()
        if len(self.rows) == 1:
            return [self.left(0, sealed[0])]
        # each joint value cut into every run's rows by one op, not one narrow per run
        last: list[list[Any]] | None = None
        if self.last is not None:
            cols = [self._split(v, spec.out_dims[o]) for v, o in zip(self.last, spec.outputs)]
            last = [[c[k] for c in cols] for k in range(len(self.rows))]
        carried = {p: self._split(self.carried[p], d) for p, d in spec.carried_dims.items()}
        return [
            Left(
                {p: vs[k] for p, vs in carried.items()},
                None if last is None else last[k],
                pieces,
                self.steps,
            )
            for k, pieces in enumerate(sealed)
        ]

    def _split(self, value: Any, dim: int | None) -> Sequence[Any]:
        """Every run's rows of a joint value batched along ``dim`` (None: the value, shared)."""
        if dim is None:
            return [value] * len(self.rows)
        return value.split_with_sizes(self.rows, dim)

    def left(self, k: int, pieces: dict[str, list[Any]]) -> Left:
        """Run ``k``'s rows of the cohort's state, with its ``pieces`` (``seal``'s)."""
        spec = self.spec
        whole = len(self.rows) == 1  # one run holds every row: its values are the joint ones
        at, n = self.offsets[k], self.rows[k]

        def rows(v: Any, dim: int | None) -> Any:
            return v if dim is None or whole else v.narrow(dim, at, n)

        last = None
        if self.last is not None:
            last = [rows(v, spec.out_dims[o]) for v, o in zip(self.last, spec.outputs)]
        carried = {p: rows(self.carried[p], d) for p, d in spec.carried_dims.items()}
        return Left(carried, last, pieces, self.steps)

    def seal(self) -> list[dict[str, list[Any]]]:
        """Each run's accumulated pieces of the steps taken so far (by channel, in step order;
        the steps of a cohort of several runs are one ``Steps``), in the order the runs
        joined."""
        spec = self.spec
        out_dims = [spec.out_dims[o] for o in spec.outputs]
        acc_dims = {ch: out_dims[k] for ch, k in spec.accumulated.items()}
        runs = len(self.rows)
        if runs == 1:
            return [{ch: list(vs) for ch, vs in self.pieces.items()}]
        # per channel, every run's pieces (cut by one op for all runs, not one per run)
        by_channel: dict[str, list[list[Any]]] = {}
        for ch, vs in self.pieces.items():
            dim = acc_dims[ch]
            if dim is None:
                by_channel[ch] = [list(vs) for _ in range(runs)]
                continue
            block = _stacked(vs, dim)
            if block is None:  # each piece cut (shapes differ, or one piece)
                by_channel[ch] = [
                    list(p) for p in zip(*(v.split_with_sizes(self.rows, dim) for v in vs))
                ]
                continue
            # each run's rows of every step, steps first (a view of its own rows)
            steps_first = block.movedim(dim + 1, 0)  # the batch dim now at dim + 1
            by_channel[ch] = [[Steps(b)] for b in steps_first.split_with_sizes(self.rows, dim + 1)]
        return [{ch: cut[k] for ch, cut in by_channel.items()} for k in range(runs)]


def cohort_spec(
    node: ir.LoopNode, body: Sequence[NodePlan], ops: Mapping[str, ir.Op], join: Join | None
) -> CohortSpec | None:
    """The ``CohortSpec`` of a simple loop with this body (``ops``: the body's ops by name),
    or None (see the module docstring)."""
    if join is None or node.stop is not None or len(body) != 1:
        return None
    comp = ops.get(body[0].ops[0])
    if comp is None:
        return None
    roles = {p.name: p.role for p in node.params}
    dims: dict[str, int | None] = {}

    def arg(a: ir.Arg, dim: Any) -> _Arg | None:
        if isinstance(a, ir.Const):
            return ("const", a.value)
        if not isinstance(a, ir.Ref) or a.name not in roles:
            return None
        role = roles[a.name]
        if isinstance(role, ir.PerStep) and not isinstance(role.source, ir.SelectStep):
            return None  # an iteration index or a table: per run at every step
        d = dim if isinstance(dim, int) else None
        if dims.setdefault(a.name, d) != d:
            return None
        return ("param", a.name)

    args = [arg(a, d) for a, d in zip(comp.args, join.in_dims)]
    if len(comp.args) != len(join.in_dims):
        return None
    kwargs = [(k, arg(a, join.kw_dims.get(k))) for k, a in comp.kwargs.items()]
    if any(a is None for a in args) or any(a is None for _, a in kwargs):
        return None
    if any(o not in join.out_dims for o in node.outputs):
        return None
    carried: list[tuple[str, int]] = []
    select: dict[str, tuple[int, int, int]] = {}
    for name, role in roles.items():
        if isinstance(role, ir.Carried):
            out_dim = join.out_dims[node.outputs[role.output]]
            if out_dim is None or dims.get(name, out_dim) != out_dim:
                return None
            dims.setdefault(name, out_dim)
            carried.append((name, role.output))
        elif isinstance(role, ir.PerStep) and isinstance(role.source, ir.SelectStep):
            src = role.source
            if name in dims and (src.start < 0 or src.step < 1):
                return None
            select[name] = (src.dim, src.start, src.step)
    return CohortSpec(
        tuple(a for a in args if a is not None),
        tuple((k, a) for k, a in kwargs if a is not None),
        dims,
        tuple(carried),
        {p: s for p, s in select.items() if p in dims},
        tuple(node.outputs),
        dict(join.out_dims),
        {ch: acc.output for ch, acc in node.accumulated.items()},
    )


def form(spec: CohortSpec, members: Sequence[Member]) -> Cohort | None:
    """A cohort of ``members`` (whose first calls share one join key), or None when one of them
    has nothing left to run or a value the cohort cannot join."""
    length = min(_left(spec, m) for m in members)
    if length < 1:
        return None
    try:
        slabs = _slabs(spec, members, length)
        carried = {
            p: _cat([m.carried[p] for m in members], d) for p, d in spec.carried_dims.items()
        }
        fixed = {
            p: _cat([m.start.fixed[p] for m in members], d) for p, d in spec.fixed_dims.items()
        }
    except _CANNOT:
        return None
    return _cohort(spec, [m.rows for m in members], length, fixed, carried, slabs)


def extend(cohort: Cohort, members: Sequence[Member]) -> Cohort | None:
    """``cohort``'s runs at their next step with ``members`` after them (whose first calls
    share its join key): the carried and invariant values of ``members`` concatenated after
    the cohort's, the per-step slices from its next step on; or None when one of them has
    nothing left to run or a value the cohort cannot join (as ``form``). ``cohort`` is left as
    it is: its runs' pieces so far are its ``seal()``, and their iterations go on from its
    ``steps``."""
    spec = cohort.spec
    length = min(cohort.length - cohort.steps, *(_left(spec, m) for m in members))
    if length < 1:
        return None
    try:
        slabs = _slabs(spec, members, length, cohort)
        carried = {
            p: _cat([cohort.carried[p], *(m.carried[p] for m in members)], d)
            for p, d in spec.carried_dims.items()
        }
        fixed = {
            p: _cat([cohort.fixed[p], *(m.start.fixed[p] for m in members)], d)
            for p, d in spec.fixed_dims.items()
        }
    except _CANNOT:
        return None
    rows = [*cohort.rows, *(m.rows for m in members)]
    return _cohort(spec, rows, length, fixed, carried, slabs, rebased=len(cohort.rows))


def shrink(cohort: Cohort, keep: Sequence[int], members: Sequence[Member]) -> Cohort | None:
    """A cohort of the runs of ``cohort`` at positions ``keep`` (``members``: each of them at
    its next iteration, its rows), once ``cohort`` took its ``length`` steps and the others
    leave: their carried and invariant rows cut from the joint values, their per-step slices
    from their next iteration on; None when one has nothing left to run or a value cannot be
    cut (as ``form``). ``cohort`` is left as it is."""
    spec = cohort.spec
    length = min(_left(spec, m) for m in members)
    if length < 1:
        return None
    spans = _spans([(cohort.offsets[k], cohort.rows[k]) for k in keep])
    try:
        slabs = _slabs(spec, members, length)
        carried = {p: _cut(cohort.carried[p], d, spans) for p, d in spec.carried_dims.items()}
        fixed = {p: _cut(cohort.fixed[p], d, spans) for p, d in spec.fixed_dims.items()}
    except _CANNOT:
        return None
    rows = [m.rows for m in members]
    return _cohort(spec, rows, length, fixed, carried, slabs, rebased=len(rows))


# what a value that cannot be joined or cut raises (a cohort is then not made)
_CANNOT = (KeyError, IndexError, RuntimeError, TypeError, AttributeError)


def _slabs(
    spec: CohortSpec, members: Sequence[Member], length: int, before: Cohort | None = None
) -> dict[str, torch.Tensor]:
    """Each per-step parameter's slices of ``members`` for ``length`` steps from each one's
    next iteration, joined along its batch dim after those of ``before`` (a cohort's own, from
    its next step)."""
    slabs: dict[str, torch.Tensor] = {}
    for p, (sdim, first, step) in spec.select.items():
        dim = spec.param_dims[p]
        at = dim if dim is None or dim < sdim else dim + 1  # in the source's dims
        parts = [] if before is None else [_narrow(before.slabs[p], sdim, before.steps, length)]
        parts += [
            _slab(m.start.sources[p], sdim, first + m.i * step, step, length) for m in members
        ]
        slabs[p] = _cat(parts, at)
    return slabs


def _cohort(
    spec: CohortSpec,
    rows: list[int],
    length: int,
    fixed: dict[str, Any],
    carried: dict[str, Any],
    slabs: dict[str, torch.Tensor],
    rebased: int = 0,
) -> Cohort:
    offsets = [0, *itertools.accumulate(rows)][:-1]
    return Cohort(
        spec, rows, length, fixed, carried, slabs, offsets=offsets, total=sum(rows), rebased=rebased
    )


def _spans(blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Row blocks (offset, rows) in order, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for at, n in blocks:
        if out and out[-1][0] + out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((at, n))
    return out


def _cut(value: Any, dim: int | None, spans: list[tuple[int, int]]) -> Any:
    """The rows of ``spans`` of a joint value (batched along ``dim``), in order."""
    if dim is None:
        return value
    return _cat([_narrow(value, dim, at, n) for at, n in spans], dim)


def _stacked(pieces: list[Any], dim: int | None) -> torch.Tensor | None:
    """A channel's pieces as one tensor, the steps axis right after the batch dim ``dim`` (one
    copy, so that each run's rows are one narrow, a ``Steps``, not one narrow per piece and
    run; and, as a channel stacked after its batch dim is, one block of memory per run, which
    ``loop_channels`` hands on without another copy), or None when they do not stack (no
    batch dim, shapes that differ, fewer than two pieces: cut one by one then)."""
    if dim is None or dim < 0 or len(pieces) < 2:
        return None
    if not all(isinstance(v, torch.Tensor) for v in pieces):
        return None
    first = pieces[0].shape
    if any(v.shape != first for v in pieces):
        return None
    return torch.stack(pieces, dim + 1)


def _left(spec: CohortSpec, m: Member) -> int:
    """Iterations ``m`` may take in a cohort: to its bound, and while its slices exist."""
    n = m.start.bound - m.i
    for p, (dim, first, step) in spec.select.items():
        src = m.start.sources.get(p)
        if not isinstance(src, torch.Tensor) or not 0 <= dim < src.dim():
            return 0
        index = first + m.i * step
        n = min(n, max(0, (src.shape[dim] - index + step - 1) // step))
    return n


def _slab(src: torch.Tensor, dim: int, start: int, step: int, length: int) -> torch.Tensor:
    if step == 1:
        return _narrow(src, dim, start, length)
    index = torch.arange(start, start + step * length, step, device=src.device)
    return src.index_select(dim, index)


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``t.narrow(dim, start, length)``, or ``t`` itself where that is all of it: a view
    costs a dispatch of its own (~15-35 us where a cohort is formed, its code cold after the
    model's steps), which a lone run's per-step input, taken whole, need not pay."""
    if start == 0 and length == t.shape[dim]:
        return t
    return t.narrow(dim, start, length)


def _cat(values: list[Any], dim: int | None) -> Any:
    if dim is None:
        return values[0]
    if len(values) == 1:
        return values[0]
    return torch.cat(values, dim=dim)
