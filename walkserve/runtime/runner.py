"""The node runner: runs a batch of work items of one plan node, on the calling thread.

The one runner of the runtime: a worker's engine loop and the in-process executor
(``local.run_local``) both call it, so they share one failure rule. No process, socket or
scheduling here: items in, per-item results out::

    results = runner.run("generate", "euler_step/denoiser", items)   # one batched call
    results[i].values    # {op: value} for the item's ``outputs`` (every op when it names none)

A component item runs its component op as part of one ``BatchedComponent`` call for the whole
batch (which splits it into compatible calls, or hands it whole to a ``forward_batch``), then
its fused glue per item; a glue item runs its glue ops per item through ``Interpreter.op``. An
item's component arguments are its ``call`` when the scheduler materialized them, else they are
read from its ``env`` by the op's arguments (items that crossed a process as values by name).

Failure rule: an item whose arguments or glue raise fails alone. When the batched call itself
raises, a batch whose calls are functional (tensors and plain values in, no ``forward_batch``)
is retried item by item, so one bad request fails alone; a component that keeps state (a
``forward_batch`` over a paged KV pool, a cache object it updates in place) may have changed it
before raising, so every item of the batch fails, the error saying it was a batched call. ``DEFER`` from a component (no KV memory
for it now) makes the item ``deferred``: the scheduler issues it again later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from walkserve.capture import dataflow, ir
from walkserve.capture.interpret import Interpreter
from walkserve.capture.model import CapturedModel
from walkserve.lowering.batched import DEFER, BatchedComponent, BatchStats
from walkserve.lowering.callables import build_callables
from walkserve.lowering.plan import ExecutablePlan, NodePlan

__all__ = ["ItemResult", "LaneStep", "NodeRunner", "RunItem", "Runnable"]


class Runnable(Protocol):
    """What the runner reads of a work item (``conductor.WorkItem`` and ``RunItem`` are)."""

    @property
    def id(self) -> int: ...
    @property
    def ops(self) -> tuple[str, ...]: ...
    @property
    def call(self) -> tuple[list[Any], dict[str, Any]] | None: ...
    @property
    def env(self) -> Mapping[str, Any]: ...
    @property
    def outputs(self) -> tuple[str, ...]: ...


# a fast lane's step (``NodeRunner.lane``): ``step(args, kwargs)`` runs the lane's item with
# those arguments and gives its values (a dict), or the ``ItemResult`` that says otherwise (a
# failure, a deferral). It keeps neither the list nor the dict it is given, which its caller
# may reuse for the next step (``cohortburst``).
LaneStep = Callable[[list[Any], dict[str, Any]], Any]


@dataclass(frozen=True)
class RunItem:
    """A work item that crossed a process (its inputs by value name, no materialized call), or
    one a rank's scheduler made. ``joined``: its ``call`` already holds that many requests'
    batched arguments, concatenated along their batch dimensions (``LoopStepper``): it is one
    call of the component, its values hold every request's rows, and it fails as one."""

    id: int
    ops: tuple[str, ...]
    env: Mapping[str, Any]
    outputs: tuple[str, ...]
    call: tuple[list[Any], dict[str, Any]] | None = None
    joined: int = 0


@dataclass(slots=True)
class ItemResult:
    """What one item produced (``{op: value}``; a map item's: ``each``, one per call), the
    error it raised, or ``deferred``."""

    item: int
    values: dict[str, Any] | None = None
    error: str | None = None
    deferred: bool = False
    each: list[dict[str, Any]] | None = None

    @property
    def made(self) -> Any:
        """What the conductor completes the item with: ``values``, or a map item's ``each``."""
        return self.values if self.each is None else self.each


@dataclass(frozen=True)
class _Node:
    plan: NodePlan
    ops: dict[str, ir.Op]
    call: BatchedComponent | None
    stateful: bool  # its component has a forward_batch: a failed batched call is not retried
    all_ops: tuple[str, ...]  # the node's ops, in order
    order: dict[str, int]  # op -> position
    items: dict[str, Callable[[Mapping[str, Any]], Any]]  # glue ``x[k]`` ops, read directly


class NodeRunner:
    """Runs the plan nodes placed on ``rank`` (every node for None) of ``captured``."""

    def __init__(
        self,
        captured: CapturedModel,
        plan: ExecutablePlan,
        rank: int | None = None,
        stats: BatchStats | None = None,
    ) -> None:
        self.rank = rank
        self.stats = stats  # call sizes, recorded only when given (a rank runs without: they grow)
        self.interp = Interpreter(captured)
        callables = build_callables(captured, plan, rank, stats=self.stats)
        self._nodes: dict[tuple[str, str], _Node] = {}
        for walk_name in plan.walks:
            walk = captured.graph.walks[walk_name]
            ops = {n.name: n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.Op)}
            for node in plan.nodes(walk_name):
                if rank is not None and rank not in node.ranks:
                    continue
                call = callables.get(f"{walk_name}:{node.name}")
                self._nodes[(walk_name, node.name)] = _Node(
                    node,
                    {name: ops[name] for name in node.ops},
                    call,
                    call is not None and hasattr(call.fn, "forward_batch"),
                    tuple(node.ops),
                    {name: k for k, name in enumerate(node.ops)},
                    {name: f for name in node.ops if (f := _item_read(ops[name])) is not None},
                )

    def counters(self) -> dict[str, int]:
        """The CUDA graphs of the nodes the plan records them for (``cudagraph``), by
        ``"<walk>:<node>/<counter>"``: replays, and whether recording failed (then the node
        runs eagerly)."""
        out: dict[str, int] = {}
        for (walk, node), entry in self._nodes.items():
            counters = getattr(entry.call, "counters", None)
            if counters is not None:
                out |= {f"{walk}:{node}/{k}": v for k, v in counters().items()}
        return out

    def nodes(self) -> list[tuple[str, str]]:
        """(walk, node) of every node this runner runs."""
        return list(self._nodes)

    def has(self, walk: str, node: str) -> bool:
        return (walk, node) in self._nodes

    def joinable(self) -> set[tuple[str, str]]:
        """(walk, node) of the component nodes that take joined items: a plain batched
        callable (no ``forward_batch``, which batches its own way)."""
        return {
            key
            for key, entry in self._nodes.items()
            if entry.call is not None and entry.call.batchable and not entry.stateful
        }

    def kind(self, walk: str, node: str) -> str:
        """``component`` or ``glue``: what the plan node is."""
        return self._nodes[(walk, node)].plan.kind

    def run(self, walk: str, node: str, items: Sequence[Runnable]) -> list[ItemResult]:
        """Run ``items`` of ``walk``'s node ``node``; one ``ItemResult`` per item, in order.
        Raises ``KeyError`` for a node this runner does not run."""
        entry = self._nodes.get((walk, node))
        if entry is None:
            where = "this runner" if self.rank is None else f"rank {self.rank}"
            raise KeyError(f"node {walk}:{node} is not placed on {where}")
        bad = [
            it for it in items if it.ops != entry.all_ops and not _subsequence(it.ops, entry.order)
        ]
        if bad:
            error = (
                f"ops {list(bad[0].ops)} are not a subsequence of node {walk}:{node}'s ops "
                f"{entry.plan.ops}"
            )
            return [ItemResult(it.id, error=error) for it in items]
        with torch.no_grad():
            first = entry.plan.ops[0]
            results: dict[int, ItemResult] = {}
            for it in items:
                if getattr(it, "joined", 0):
                    results[it.id] = self._joined(entry, it)
            comp = [
                it
                for it in items
                if entry.call is not None and it.ops[:1] == (first,) and it.id not in results
            ]
            if comp:
                for it, out in zip(comp, self._component(entry, comp)):
                    results[it.id] = out
            for it in items:
                if it.id not in results:
                    results[it.id] = self._finish(entry, it, {})
        return [results[it.id] for it in items]

    @contextlib.contextmanager
    def lane(self, walk: str, node: str, item: RunItem) -> Iterator[LaneStep]:
        """The fast lane's runner (``RankScheduler.lane``): the ``LaneStep`` that runs the
        joined ``item`` (its ops, outputs and count) with each step's arguments, as ``run``
        runs a joined item (same values, same failure rule), without ``run``'s checks per step;
        a block of steps under one ``torch.no_grad``. Raises ``KeyError`` for a node this runner
        does not run, and ``ValueError`` for an item that is not a joined call of its
        component."""
        entry = self._nodes.get((walk, node))
        if entry is None:
            where = "this runner" if self.rank is None else f"rank {self.rank}"
            raise KeyError(f"node {walk}:{node} is not placed on {where}")
        if not item.joined or entry.call is None or item.ops[:1] != entry.all_ops[:1]:
            raise ValueError(f"node {walk}:{node}: a lane steps a joined call of its component")
        if item.ops != entry.all_ops and not _subsequence(item.ops, entry.order):
            raise ValueError(f"ops {list(item.ops)} are not a subsequence of node {walk}:{node}")
        with torch.no_grad():
            yield self._lane_step(entry, item)

    # ------------------------------------------------------------------ internals

    def _lane_step(self, entry: _Node, item: RunItem) -> LaneStep:
        """``_joined`` of ``item`` with each step's arguments, for the fast lane: where the
        item's other ops are reads of the component's output (a tuple taken apart) and it
        makes nothing else, the checks and lookups ``_joined`` and ``_finish`` make per call
        are made once here; anything out of the way (a failure, ``DEFER``, a read that
        raises) goes through ``_finish``, which says what ``run`` would."""
        joined = self._joined
        op = entry.ops[entry.plan.ops[0]]
        comp = op.name
        names = item.outputs or item.ops

        def general(args: list[Any], kwargs: dict[str, Any]) -> Any:
            r = joined(entry, item, (list(args), dict(kwargs)))
            good = r.error is None and not r.deferred and r.each is None and r.values is not None
            return r.values if good else r

        if entry.call is None or item.ops[:1] != (comp,) or not set(names) <= set(item.ops):
            return general
        reads: list[tuple[str, Callable[[Mapping[str, Any]], Any]]] = []
        for name in item.ops[1:]:
            read = entry.items.get(name)
            if read is None:  # glue the interpreter runs
                return general
            reads.append((name, read))
        call_joined, count, item_id, finish = entry.call.joined, item.joined, item.id, self._finish
        fn = entry.call.direct()  # where ``joined`` adds nothing: called as it is
        whole = not reads and tuple(names) == (comp,)  # its output, as it is

        def step(args: list[Any], kwargs: dict[str, Any]) -> Any:
            try:
                out = fn(*args, **kwargs) if fn is not None else call_joined((args, kwargs), count)
            except Exception as e:
                return ItemResult(item_id, error=_joined_error(op, count, e))
            if out is DEFER or isinstance(out, _Failure):
                return finish(entry, item, {comp: out})
            if whole:
                return {comp: out}
            env = {comp: out}
            try:
                for name, read in reads:
                    env[name] = read(env)
            except Exception:
                return finish(entry, item, {comp: out})  # the interpreter says why
            return {name: env[name] for name in names}

        return step

    def _component(self, entry: _Node, items: Sequence[Runnable]) -> list[ItemResult]:
        assert entry.call is not None
        op = entry.ops[entry.plan.ops[0]]
        calls: list[tuple[list[Any], dict[str, Any]]] = []
        good: list[Runnable] = []
        counts: list[int | None] = []  # a good map item's calls (its iterations'); None: one
        failed: dict[int, ItemResult] = {}
        for it in items:
            many = getattr(it, "calls", None)
            try:
                if many is None:
                    calls.append(it.call if it.call is not None else self._call(op, it.env))
                else:
                    calls += many
                counts.append(None if many is None else len(many))
                good.append(it)
            except Exception as e:
                failed[it.id] = ItemResult(it.id, error=f"node {op.name}: {e}")
        outs: list[Any] = []
        try:
            outs = entry.call(calls) if calls else []
        except Exception as e:
            if len(good) > 1 and not entry.stateful and all(map(_functional, calls)):
                retried = [r for it in good for r in self._component(entry, [it])]
                by_id = {r.item: r for r in retried} | failed
                return [by_id[it.id] for it in items]
            where = f" ({op.source})" if op.source else ""
            others = "" if len(good) == 1 else f" (a batched call of {len(good)} requests)"
            error = f"node {op.name} ({op.target}){where} failed{others}: {e}"
            outs = [_Failure(error)] * len(calls)
        done: dict[int, ItemResult] = {}
        at = 0
        for it, n in zip(good, counts):
            if n is None:
                done[it.id] = self._finish(entry, it, {op.name: outs[at]})
                at += 1
            else:
                done[it.id] = self._each(entry, it, outs[at : at + n])
                at += n
        done |= failed
        return [done[it.id] for it in items]

    def _each(self, entry: _Node, item: Runnable, outs: Sequence[Any]) -> ItemResult:
        """A map item's result: its glue run on each call's output; the first error fails it
        whole, a ``DEFER`` defers it whole (its calls run again together)."""
        comp = entry.plan.ops[0]
        alone = item.ops == (comp,) and (item.outputs or item.ops) == (comp,)  # no glue
        if alone and not any(out is DEFER or isinstance(out, _Failure) for out in outs):
            return ItemResult(item.id, each=[{comp: out} for out in outs])  # as _finish makes
        each: list[dict[str, Any]] = []
        for out in outs:
            r = self._finish(entry, item, {comp: out})
            if r.error is not None or r.deferred:
                return r
            assert r.values is not None
            each.append(r.values)
        return ItemResult(item.id, each=each)

    def _joined(
        self, entry: _Node, item: Runnable, call: tuple[list[Any], dict[str, Any]] | None = None
    ) -> ItemResult:
        """A joined item: one call of the component over its requests' rows (see ``RunItem``);
        ``call``: its arguments, when the item holds none (the fast lane's)."""
        op = entry.ops[entry.plan.ops[0]]
        call = item.call if call is None else call
        if entry.call is None or call is None or item.ops[:1] != (op.name,):
            return ItemResult(item.id, error=f"node {op.name}: a joined item needs its component")
        count = getattr(item, "joined", 0)
        try:
            out = entry.call.joined(call, count)
        except Exception as e:
            return ItemResult(item.id, error=_joined_error(op, count, e))
        return self._finish(entry, item, {op.name: out})

    def _call(self, op: ir.Op, env: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        value = self.interp.value
        return [value(a, env) for a in op.args], {k: value(a, env) for k, a in op.kwargs.items()}

    def _finish(self, entry: _Node, item: Runnable, made: dict[str, Any]) -> ItemResult:
        """Run the item's glue (after its component's output, in ``made``) and collect."""
        out = next(iter(made.values()), None) if made else None
        if isinstance(out, _Failure):
            return ItemResult(item.id, error=out.error)
        if made and out is DEFER:
            return ItemResult(item.id, deferred=True)
        names = item.outputs or item.ops
        if len(item.ops) == len(made):  # a component alone: nothing to run here
            try:
                return ItemResult(item.id, {name: made[name] for name in names})
            except KeyError as e:
                return ItemResult(item.id, error=f"node {entry.plan.name} makes no value {e}")
        env = dict(item.env)
        env.update(made)
        try:
            for name in item.ops:
                if name in made:
                    continue
                read = entry.items.get(name)
                if read is not None:
                    try:
                        env[name] = read(env)
                        continue
                    except Exception:
                        pass  # the interpreter runs it, and says why it fails
                env[name] = self.interp.op(entry.ops[name], env)
        except Exception as e:
            return ItemResult(item.id, error=str(e))
        try:
            return ItemResult(item.id, {name: env[name] for name in names})
        except KeyError as e:
            return ItemResult(item.id, error=f"node {entry.plan.name} makes no value {e}")


def _item_read(op: ir.Op) -> Callable[[Mapping[str, Any]], Any] | None:
    """``op`` as a direct read when it is glue ``value[k]`` with a constant ``k`` (how a
    component's tuple of outputs is taken apart, every step of a loop that calls one): what the
    interpreter computes for it, without its per-call lookups. None for any other op."""
    if op.kind != "glue" or op.target != "function:operator.getitem" or op.kwargs:
        return None
    if len(op.args) != 2 or not isinstance(op.args[0], ir.Ref):
        return None
    source, key = op.args[0].name, op.args[1]
    if not isinstance(key, ir.Const) or not isinstance(key.value, (int, str)):
        return None
    k = key.value
    return lambda env: env[source][k]


def _joined_error(op: ir.Op, count: int, e: Exception) -> str:
    where = f" ({op.source})" if op.source else ""
    return f"node {op.name} ({op.target}){where} failed (a joined call of {count}): {e}"


def _subsequence(ops: Sequence[str], order: Mapping[str, int]) -> bool:
    positions = [order.get(name, -1) for name in ops]
    return bool(ops) and -1 not in positions and positions == sorted(set(positions))


def _functional(call: tuple[list[Any], dict[str, Any]]) -> bool:
    """Only tensors and plain values (no object a component could update in place)."""

    def plain(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (torch.Tensor, int, float, bool, str))

    return plain(call[0]) and all(plain(v) for v in call[1].values())


@dataclass(frozen=True)
class _Failure:
    error: str
