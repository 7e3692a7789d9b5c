"""An in-process executor for the conductor: every work item runs here, on this thread.

For tests and single-process runs. It owns nothing the conductor owns: it runs what
``Conductor.ready()`` returns and reports results back, one round at a time::

    while requests remain:
        items = conductor.ready()                   # schedule
        results = executor.run(items)               # run
        executor.report(conductor, results)         # postprocess

``run`` groups a round's items by ``(walk, node, kind)``: a component group is one call of the
node's lowered ``BatchedComponent`` (``lowering.batched.build_callables``) over up to
``max_batch`` requests, which splits it into compatible calls; fused glue and glue items run
per request through ``Interpreter.op``. A group that raises is retried item by item, so one
bad request fails alone. Requests may arrive at later rounds (``arrivals``), which is how
requests join a running batch at iteration boundaries (continuous batching).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.interpret import Interpreter
from walkserve.capture.model import CapturedModel
from walkserve.lowering.batched import DEFER, BatchStats, build_callables
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.conductor import (
    Conductor,
    ConductorStats,
    Event,
    Failed,
    Output,
    WorkItem,
)


@dataclass(frozen=True)
class ItemResult:
    """What one item produced (``{op: value}``), or the error it raised."""

    item: int
    values: dict[str, Any] | None = None
    error: str | None = None
    deferred: bool = False  # the component could not run it now: issue it again


@dataclass(frozen=True)
class Dispatch:
    """One group run in round ``round``: its members as ``(request, frame, speculative)``
    and, for a component, the sizes of the calls the batched component made."""

    round: int
    walk: str
    node: str
    kind: str
    members: tuple[tuple[str, tuple[int, ...], bool], ...]
    calls: tuple[int, ...] = ()


@dataclass
class LocalResult:
    outputs: dict[str, dict[str, Any]]  # client outputs per request (later walks win)
    failed: dict[str, str]  # request -> error
    events: list[Event]
    histogram: dict[str, Counter[int]]  # "walk:node" -> component call sizes
    dispatches: list[Dispatch]
    stats: ConductorStats  # at the end
    max_buffered: int  # most stream items buffered after any round


class LocalExecutor:
    """Runs work items of ``captured`` as ``plan`` lowered them; ``dispatches`` records every
    group it ran, ``round`` counts ``run`` calls."""

    def __init__(
        self, captured: CapturedModel, plan: ExecutablePlan, max_batch: int | None = None
    ) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.stats = BatchStats()
        self.callables = build_callables(captured, plan, stats=self.stats)
        self.interp = Interpreter(captured)
        self.ops = {
            name: {n.name: n for n in ir.iter_nodes(w.body) if isinstance(n, ir.Op)}
            for name, w in captured.graph.walks.items()
        }
        self.dispatches: list[Dispatch] = []
        self.round = 0

    def run(self, items: Sequence[WorkItem]) -> list[ItemResult]:
        groups: dict[tuple[str, str, str], list[WorkItem]] = {}
        for item in items:
            groups.setdefault((item.walk, item.node, item.kind), []).append(item)
        size = self.max_batch or max(len(items), 1)
        results: list[ItemResult] = []
        with torch.no_grad():
            for group in groups.values():
                for start in range(0, len(group), size):
                    results += self._group(group[start : start + size])
        self.round += 1
        return results

    @staticmethod
    def report(conductor: Conductor, results: Sequence[ItemResult]) -> None:
        for r in results:
            if r.error is not None:
                conductor.fail(r.item, r.error)
            elif r.deferred:
                conductor.defer(r.item)
            else:
                conductor.complete(r.item, r.values)

    def _group(self, group: list[WorkItem]) -> list[ItemResult]:
        first = group[0]
        members = tuple((it.request, it.frame, it.speculative) for it in group)
        if first.kind == "glue":
            self.dispatches.append(Dispatch(self.round, first.walk, first.node, "glue", members))
            return [self._finish(it, None) for it in group]
        fn = self.callables[f"{first.walk}:{first.node}"]
        before = len(self.stats.calls.get(fn.name, []))
        try:
            outs = fn([it.call for it in group if it.call is not None])
        except Exception as e:
            if len(group) > 1:
                return [r for it in group for r in self._group([it])]
            return [ItemResult(first.id, error=f"{type(e).__name__}: {e}")]
        calls = tuple(self.stats.calls.get(fn.name, [])[before:])
        self.dispatches.append(
            Dispatch(self.round, first.walk, first.node, "component", members, calls)
        )
        return [self._finish(it, out) for it, out in zip(group, outs)]

    def _finish(self, item: WorkItem, out: Any) -> ItemResult:
        """Run the item's glue (fused after the component, or the whole glue item)."""
        if out is DEFER:
            return ItemResult(item.id, deferred=True)
        env = dict(item.env)
        values: dict[str, Any] = {}
        names = item.ops
        if item.kind == "component":
            env[names[0]] = values[names[0]] = out
            names = names[1:]
        ops = self.ops[item.walk]
        try:
            for name in names:
                env[name] = values[name] = self.interp.op(ops[name], env)
        except Exception as e:
            return ItemResult(item.id, error=str(e))
        return ItemResult(item.id, values)


def run_local(
    captured: CapturedModel,
    plan: ExecutablePlan,
    requests: Mapping[str, Mapping[str, Any]],
    *,
    walks: str | Mapping[str, str] | None = None,
    arrivals: Mapping[str, int] | None = None,
    speculate: bool = True,
    max_batch: int | None = None,
    stream_buffer_limit: int = 64,
) -> LocalResult:
    """Serve ``requests`` (id -> inputs) to the end in this process. ``walks``: the start walk
    of every request, or per request (default: the entry walk); ``arrivals``: the round at
    which each request is submitted (default 0)."""
    conductor = Conductor(
        captured, plan, speculate=speculate, stream_buffer_limit=stream_buffer_limit
    )
    executor = LocalExecutor(captured, plan, max_batch)
    arrive = dict.fromkeys(requests, 0) | dict(arrivals or {})
    queue = sorted(requests, key=lambda rid: arrive[rid])
    events: list[Event] = []
    max_buffered = 0
    while queue or not conductor.idle():
        while queue and arrive[queue[0]] <= executor.round:
            rid = queue.pop(0)
            start = walks if isinstance(walks, str) or walks is None else walks.get(rid)
            conductor.submit(rid, requests[rid], start)
        items = conductor.ready()  # schedule
        results = executor.run(items)  # run
        executor.report(conductor, results)  # postprocess
        events += conductor.events()
        max_buffered = max(max_buffered, conductor.stats().buffered_stream_items)
        if not items and not queue and not conductor.idle():
            raise RuntimeError(f"the conductor stalled with work left: {conductor.stats()}")
    outputs: dict[str, dict[str, Any]] = {rid: {} for rid in requests}
    failed: dict[str, str] = {}
    for e in events:
        if isinstance(e, Output):
            outputs[e.request][e.name] = e.value
        elif isinstance(e, Failed):
            failed[e.request] = e.error
    histogram: dict[str, Counter[int]] = {}
    for d in executor.dispatches:
        histogram.setdefault(f"{d.walk}:{d.node}", Counter()).update(d.calls)
    return LocalResult(
        outputs, failed, events, histogram, executor.dispatches, conductor.stats(), max_buffered
    )
