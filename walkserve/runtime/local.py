"""The in-process executor: the conductor, one rank scheduler and the node runner, all here.

For tests and single-process runs. It owns nothing the conductor or the rank scheduler owns: it
runs what ``Conductor.ready()`` returns and reports back, one round at a time, exactly as the
server and its workers do across processes::

    while requests remain:
        items = conductor.ready()                   # schedule
        results = executor.run(items)               # run: node items now; region items are
                                                    #   started in the rank scheduler, which
                                                    #   steps every live region run once
        executor.report(conductor, results)         # postprocess (node results, region exits)

Node items of a round are grouped by ``(walk, node, kind)``: a component group is one call of
the node's lowered ``BatchedComponent`` over up to ``max_batch`` requests (``runner``'s failure
rule: a bad request fails alone). Region items go to one ``RankScheduler`` for every rank (in
one process ranks do not matter), whose steps run through the same runner. Requests may arrive
at later rounds (``arrivals``): that is how requests join a running batch at iteration
boundaries (continuous batching).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from walkserve.capture.model import CapturedModel
from walkserve.lowering.batched import BatchStats
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.conductor import (
    Conductor,
    ConductorStats,
    Event,
    Failed,
    Output,
    WorkItem,
)
from walkserve.runtime.rankreports import (
    NodeBatchDone,
    RegionConsumed,
    RegionDone,
    RegionFailed,
    RegionOutput,
    RegionStreamed,
    Report,
    Step,
)
from walkserve.runtime.rankscheduler import RankScheduler
from walkserve.runtime.regionwalk import region_walks
from walkserve.runtime.runner import ItemResult, NodeRunner, Runnable


@dataclass(frozen=True)
class Dispatch:
    """One group run in round ``round``: its members as ``(request, frame, speculative)``
    and, for a component, the sizes of the calls the batched component made. ``region``:
    run by the rank scheduler for region runs (frames are then the region walk's)."""

    round: int
    walk: str
    node: str
    kind: str
    members: tuple[tuple[str, tuple[int, ...], bool], ...]
    calls: tuple[int, ...] = ()
    region: bool = False


@dataclass
class LocalResult:
    outputs: dict[str, dict[str, Any]]  # client outputs per request (later walks win)
    failed: dict[str, str]  # request -> error
    events: list[Event]
    histogram: dict[str, Counter[int]]  # "walk:node" -> component call sizes
    dispatches: list[Dispatch]
    stats: ConductorStats  # at the end
    max_buffered: int  # most stream items buffered after any round
    rank_values: int = 0  # values the rank scheduler holds at the end
    loop_counters: dict[str, int] = field(default_factory=dict)  # LoopStepper.counters()


class LocalExecutor:
    """Runs work items of ``captured`` as ``plan`` lowered them; ``dispatches`` records every
    group it ran, ``round`` counts ``run`` calls."""

    def __init__(
        self,
        captured: CapturedModel,
        plan: ExecutablePlan,
        max_batch: int | None = None,
        *,
        speculate: bool = True,
        stream_buffer_limit: int = 64,
    ) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.stats = BatchStats()
        self.runner = NodeRunner(captured, plan, None, self.stats)
        self.ranks = RankScheduler(
            region_walks(captured, plan, None),
            speculate=speculate,
            stream_buffer_limit=stream_buffer_limit,
            max_batch=max_batch,
            joins=self.runner.joinable(),
        )
        self.dispatches: list[Dispatch] = []
        self.round = 0
        self._reports: list[Report] = []
        self._requests: dict[int, str] = {}  # region item -> request

    def run(self, items: Sequence[WorkItem]) -> list[ItemResult]:
        """Run the node items of one round and start its region items; then step every live
        region run once. Region exits are reported by the next ``report``."""
        groups: dict[tuple[str, str, str], list[WorkItem]] = {}
        for item in items:
            if item.kind == "region":
                self._requests[item.id] = item.request
                self.ranks.start(item.id, item.request, item.walk, item.node, item.env, item.stream)
            else:
                groups.setdefault((item.walk, item.node, item.kind), []).append(item)
        size = self.max_batch or max(len(items), 1)
        results: list[ItemResult] = []
        for (walk, node, kind), group in groups.items():
            for start in range(0, len(group), size):
                part = group[start : start + size]
                members = tuple((it.request, it.frame, it.speculative) for it in part)
                results += self._run(walk, node, kind, part, members, False)
        for step in self.ranks.schedule():
            members = tuple(m for it in step.items for m in self._members(it))
            kind = self.runner.kind(step.walk, step.node)
            if kind == "component" and not self._is_component(step):
                kind = "glue"  # the glue part of a split node
            self.ranks.update(
                step, self._run(step.walk, step.node, kind, step.items, members, True)
            )
        self._reports += self.ranks.reports()
        self.round += 1
        return results

    def report(self, conductor: Conductor, results: Sequence[ItemResult]) -> int:
        """Hand ``results`` and the region reports to ``conductor``; returns how many region
        reports there were."""
        for r in results:
            if r.error is not None:
                conductor.fail(r.item, r.error)
            elif r.deferred:
                conductor.defer(r.item)
            else:
                conductor.complete(r.item, r.values)
        reports, self._reports = self._reports, []
        for rep in reports:
            if isinstance(rep, RegionStreamed):
                conductor.streamed(rep.item, rep.channel, rep.index, rep.value)
            elif isinstance(rep, RegionOutput):
                conductor.partial(rep.item, rep.outputs)
            elif isinstance(rep, RegionDone):
                conductor.complete(rep.item, rep.outputs)
            elif isinstance(rep, RegionFailed):
                conductor.fail(rep.item, rep.error)
            elif isinstance(rep, RegionConsumed):
                conductor.consumed(rep.item, rep.stream, rep.base, rep.received, rep.closed)
            else:
                assert not isinstance(rep, NodeBatchDone)  # node batches run above
        self.ranks.drop(conductor.dropped())
        for feed in conductor.feeds():
            self.ranks.feed(feed.item, feed.stream, feed.pieces, feed.finished)
        for credit in conductor.credits():
            self.ranks.credit(credit.item, credit.channel, credit.items)
        self._reports += self.ranks.reports()
        return len(reports)

    def idle(self) -> bool:
        return self.ranks.idle() and not self._reports

    def _run(
        self,
        walk: str,
        node: str,
        kind: str,
        items: Sequence[Runnable],
        members: tuple[tuple[str, tuple[int, ...], bool], ...],
        region: bool,
    ) -> list[ItemResult]:
        name = node
        before = len(self.stats.calls.get(name, []))
        results = self.runner.run(walk, node, items)
        calls = tuple(self.stats.calls.get(name, [])[before:]) if kind == "component" else ()
        self.dispatches.append(Dispatch(self.round, walk, node, kind, members, calls, region))
        return results

    def _members(self, item: Any) -> list[tuple[str, tuple[int, ...], bool]]:
        if not hasattr(item, "request"):  # a loop stepper's item: (run, iteration) of each run
            found = self.ranks.loops.members(item.id)
            assert found
            out: list[tuple[str, tuple[int, ...], bool]] = []
            for run_id, i in found:
                run = self.ranks._runs.get(run_id)
                request = self._requests.get(run.item, run_id) if run is not None else run_id
                out.append((request, (i,), False))
            return out
        run = self.ranks._runs.get(item.request)
        request = self._requests.get(run.item, item.request) if run is not None else item.request
        return [(request, item.frame, item.speculative)]

    @staticmethod
    def _is_component(step: Step) -> bool:
        return any(getattr(it, "kind", "component") == "component" for it in step.items)


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
    executor = LocalExecutor(
        captured,
        plan,
        max_batch,
        speculate=speculate,
        stream_buffer_limit=stream_buffer_limit,
    )
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
        ran = len(executor.dispatches)
        results = executor.run(items)  # run
        reported = executor.report(conductor, results)  # postprocess
        events += conductor.events()
        max_buffered = max(
            max_buffered,
            conductor.stats().buffered_stream_items
            + executor.ranks.conductor.stats().buffered_stream_items,
        )
        stalled = not items and len(executor.dispatches) == ran and not reported
        if stalled and not queue and not conductor.idle():
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
        outputs,
        failed,
        events,
        histogram,
        executor.dispatches,
        conductor.stats(),
        max_buffered,
        executor.ranks.stats().live_values,
        executor.ranks.loops.counters(),
    )
