"""The rank scheduler: what one rank runs next, for every request delegated to it.

Pure (no sockets, threads, processes or CUDA): the worker's engine loop (``engine.EngineLoop``)
and the in-process executor (``local.run_local``) drive it, tests drive it with fabricated
results. It owns the region runs delegated to its rank and the node batches the conductor sent
it, and nothing else; values are opaque to it (those of its regions are the rank's own objects)::

    scheduler.start(item, request, walk, region, inputs)   # a region run, once per request
    scheduler.add_batch(batch, walk, node, items)          # a node batch of the conductor's
    for step in scheduler.schedule():                      # schedule: every ready item, by node
        scheduler.update(step, runner.run(step.walk, step.node, step.items))   # run, postprocess
    scheduler.reports()      # RegionStreamed, RegionDone, RegionFailed, NodeBatchDone (drained)

Region runs are walks of their own (``regionwalk``) inside one ``Conductor``: the same loop
semantics as the reference interpreter and the conductor (``capture.loopsem``): stops evaluated
as each step's values exist, carried values passed on in place, streams between loops of the
region cut by their chunk policies with bounded buffers. Every ``schedule`` hands out all ready
items of every run, grouped by node: requests at different iterations share a batch
(continuous batching), and a region's parallel branches are handed out together. Nothing of a
run is reported until its exit, except the committed items of the region's streamed channels
(a walk's client streams) and failures.

Speculation inside a region: an iteration of a dynamic loop may start before the previous
stop is known (``speculate``) only where the stop is a separate item from the step (a stop
fused into the step's node arrives with the step's values, so nothing is started early); a
discarded iteration is counted in ``stats().wasted_steps``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from walkserve.runtime.conductor import Conductor, Failed, Finished, Output, StreamItem
from walkserve.runtime.loopshare import Band
from walkserve.runtime.loopstep import (
    LoopDone,
    LoopFailed,
    LoopStepper,
    LoopStreamed,
    LoopStreamedRows,
    streamed_items,
)
from walkserve.runtime.rankreports import (
    Lane,
    NodeBatchDone,
    RankStats,
    RegionConsumed,
    RegionDone,
    RegionFailed,
    RegionOutput,
    RegionStreamed,
    Report,
    Step,
)
from walkserve.runtime.regionwalk import RegionWalks, region_walk_name
from walkserve.runtime.runner import ItemResult, LaneStep, Runnable
from walkserve.runtime.stepvalues import StepValues

__all__ = ["RankScheduler"]


@dataclass(eq=False)
class _Run:
    item: int
    request: str
    walk: str  # the region walk
    streamed: frozenset[str]  # client streams and forwarded channels: reported per item
    outputs: dict[str, Any] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)  # fed stream -> pieces
    progress: dict[str, tuple[int, bool, int]] = field(default_factory=dict)  # last reported


class RankScheduler:
    """See the module docstring. ``regions``: the region walks of this rank's regions;
    ``max_batch``: most items per step (None: all ready items of a node)."""

    def __init__(
        self,
        regions: RegionWalks,
        *,
        speculate: bool = True,
        stream_buffer_limit: int = 64,
        max_batch: int | None = None,
        fast_loops: bool = True,
        joins: Collection[tuple[str, str]] = (),
    ) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.regions = regions
        self.max_batch = max_batch
        self.conductor = Conductor(
            regions.captured,
            regions.plan,
            speculate=speculate,
            stream_buffer_limit=stream_buffer_limit,
            eager_outputs=True,
            fed={name: r.fed for name, r in regions.regions.items() if r.fed},
            fast_loops=fast_loops,
            maps=[  # the region walks' nodes the runner takes joined calls of
                (name, node)
                for name in regions.regions
                for walk, node in joins
                if walk == regions.walk_of[name]
            ],
            map_calls=max_batch,
        )
        self.loops = LoopStepper(regions, max_batch=max_batch, joins=joins)
        self.stream_buffer_limit = stream_buffer_limit
        self._runs: dict[str, _Run] = {}
        self._fed_runs: set[str] = set()  # runs with fed streams
        self._by_request: dict[str, set[str]] = {}
        self._external: list[Step] = []
        self._reports: list[Report] = []
        self.batch_sizes: dict[int, int] = {}
        # Nothing reached the rank since the last schedule(), whose inner conductor had
        # nothing ready, and no step since reported anything to it: lane() may step a cohort.
        self._settled = False

    # ------------------------------------------------------------------ commands

    def start(
        self,
        item: int,
        request: str,
        walk: str,
        region: str,
        inputs: Mapping[str, Any],
        stream: bool = True,
    ) -> None:
        """Run region ``region`` of ``walk`` for ``request`` (the conductor's item ``item``);
        ``stream``: report its client streams item by item (else only forwarded streams)."""
        self._settled = False
        name = region_walk_name(walk, region)
        plan = self.regions.regions.get(name)
        run_id = str(item)
        if plan is None:
            self._reports.append(
                RegionFailed(item, f"region {region} of walk {walk!r} is not here")
            )
            return
        if run_id in self._runs:
            self._reports.append(RegionFailed(item, f"region item {item} is already running"))
            return
        for channel in plan.forwards:  # until its consumers say how far they are
            self.loops.credit(run_id, channel, self.stream_buffer_limit)
        try:
            # the region's forwarded streams are streamed outputs of its walk: they stream
            # whether the client reads the others or not
            streamed = True if stream else frozenset(plan.forwards)
            self.conductor.submit(run_id, inputs, name, stream=streamed)
        except Exception as e:
            self._reports.append(RegionFailed(item, f"region {region} of {walk!r}: {e}"))
            return
        run = _Run(item, request, name, frozenset([*plan.streamed, *plan.forwards]))
        if not stream:
            run.streamed = frozenset(plan.forwards)
        self._runs[run_id] = run
        if plan.fed:
            self._fed_runs.add(run_id)
        self._by_request.setdefault(request, set()).add(run_id)
        for channel in plan.forwards:  # until its consumers say how far they are
            self.conductor.credit(run_id, channel, self.stream_buffer_limit)
        self._collect()

    def feed(self, item: int, stream: str, pieces: Sequence[Any], finished: bool) -> None:
        """Items of fed stream ``stream`` of region item ``item``, from another region."""
        self._settled = False
        run = self._runs.get(str(item))
        if run is None:
            return
        run.received[stream] = run.received.get(stream, 0) + len(pieces)
        self.conductor.feed(str(item), stream, pieces, finished)
        self._collect()

    def credit(self, item: int, channel: str, items: int) -> None:
        """Region item ``item`` may commit items of ``channel`` up to ``items``."""
        self._settled = False
        if str(item) in self._runs:
            self.loops.credit(str(item), channel, items)
            self.conductor.credit(str(item), channel, items)
            self._collect()

    def add_batch(self, batch: int, walk: str, node: str, items: Sequence[Runnable]) -> None:
        """A node batch from the conductor: run as it is at the next ``schedule``."""
        self._settled = False
        self._external.append(Step(walk, node, list(items), batch))

    def cancel(self, request: str) -> None:
        """Drop every run of ``request`` (no report)."""
        self._settled = False
        for run_id in self._by_request.pop(request, set()):
            self._drop(run_id)

    def drop(self, items: Sequence[int]) -> None:
        """Drop the runs of these region items (the conductor no longer wants them)."""
        self._settled = False
        for item in items:
            run = self._runs.get(str(item))
            if run is not None:
                self._by_request.get(run.request, set()).discard(str(item))
                self._drop(str(item))

    # ------------------------------------------------------------------ the loop

    def schedule(self) -> list[Step]:
        """Every ready item of every run, one step per node (split at ``max_batch``), and the
        conductor's node batches."""
        groups: dict[tuple[str, str, str], list[Runnable]] = {}
        if self.loops.reporting():  # streamed items the fast lane held (``lane``)
            self._loop_reports()
        ready = self.conductor.ready()
        # settled unless a ready item runs as a step of this pass: its results reach the inner
        # conductor (``update``). A loop item goes to the stepper, whose reports unsettle it
        # (``_loop_reports``), so that a loop just started may take the fast lane at once
        self._settled = all(it.kind == "loop" for it in ready)
        for it in ready:
            if it.kind == "loop":
                self.loops.start(it)
                continue
            key = (self.regions.walk_of[it.walk], it.node, it.kind)
            groups.setdefault(key, []).append(it)
        self._loop_reports()
        todo: list[tuple[str, str, Sequence[Runnable], bool]] = [
            (walk, node, group, False) for (walk, node, _), group in groups.items()
        ]
        todo += [(walk, node, items, True) for walk, node, items in self.loops.schedule()]
        steps: list[Step] = []
        for walk, node, group, loops in todo:
            for part in _parts(group, self.max_batch):
                steps.append(Step(walk, node, part, None, loops))
        steps += self._external
        self._external = []
        return steps

    def lane(self) -> Lane | None:
        """The engine's fast lane: when all this rank runs is one cohort of a simple loop
        (``LoopStepper.lane``), nothing reached the rank since the last ``schedule`` (whose
        inner conductor had nothing ready) and no step since reported anything to it, the
        cohort to step back to back without scheduling everything again; None otherwise (call
        ``schedule``)."""
        if not self._settled or self._external:
            return None
        band = self.loops.lane()
        return None if band is None else self._lane(band)

    def lane_of(self, step: Step) -> Lane | None:
        """``lane``, taking over ``step``: ``schedule``'s only step, a lone cohort's (its
        first, as a loop just started makes it), which the lane then makes as its first
        instead of the engine running it as a step; None (``step`` is to be run) otherwise."""
        if not step.loops or len(step.items) != 1 or not self._settled or self._external:
            return None
        band = self.loops.lane_of(step.items[0].id)
        return None if band is None else self._lane(band, step.items[0].call)

    def _lane(self, band: Band, first: Any = None) -> Lane:
        """``band``'s lane; ``first``: its first step's call, made by ``schedule`` (the cohort
        has not changed since), else made when the lane takes it."""
        item = self.loops.lane_item(band)
        sizes, n, loops = self.batch_sizes, item.joined, self.loops
        # streamed items that may wait until the lane ends (``RegionItems.deferrable``): given
        # to the inner conductor then, all at once, not one call and chunk advance per step
        held = {
            (run.item, ch)
            for _, run in band.streaming
            for ch in run.start.streams
            if self.conductor.deferrable(run.item, ch)
        }
        seen: dict[int, tuple[Any, bool]] = {}  # ``urgent``'s answers per layout, this lane
        budget = 0  # steps the next commits may make quickly (``LoopStepper.lane_budget``)

        def steps(run: LaneStep, stop: Callable[[], bool]) -> Any:
            # the steps within the budget at once: nothing but the cohort changes, the rank
            # stays settled; then one that ``commit`` commits in full
            nonlocal budget, first
            if first is not None:
                call, first = first, None
                return run(*call)
            if budget > 0:
                made, left, stopped = loops.lane_burst(band, run, budget, stop)
                budget -= made
                if left is not None:
                    return left
                if stopped:
                    return None
            return run(*band.cohort.call())

        def commit(result: Any) -> bool:
            nonlocal budget
            if type(result) is dict:
                result = ItemResult(item.id, result)
            end()
            sizes[n] = sizes.get(n, 0) + 1
            since = loops.waiting_reports()
            more = loops.lane_step(band, result)
            # what its step committed may concern the inner conductor; held items too when
            # the lane stops (its credit may be what they bring: consumers start on them)
            if loops.reporting() and (not held or not more or loops.urgent(since, held, seen)):
                self._loop_reports()
                self._collect()
                if not more and self._settled:
                    more = loops.lane_open(band)
            more = more and self._settled
            if more:
                budget = loops.lane_budget(band, held)
            return more

        def end() -> None:  # the quick commits' reports and counts, as each step's would be
            nonlocal budget
            budget = 0
            quick = loops.lane_settle()
            if quick:
                sizes[n] = sizes.get(n, 0) + quick

        return Lane(band.loop.walk, band.loop.body[0].name, item, steps, commit, end)

    def _count_batch(self, step: Step) -> None:
        """Record the size of a step that ran: its requests (a loop stepper's joined item holds
        several). A lane counts its own steps, one per commit."""
        items = step.items
        n = sum(getattr(it, "joined", 0) or 1 for it in items) if step.loops else len(items)
        self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1

    def update(self, step: Step, results: Sequence[ItemResult]) -> None:
        """The results of ``step``, one per item, in order."""
        if step.external is not None:
            self._reports.append(NodeBatchDone(step.external, list(results)))
            return
        self._count_batch(step)
        if step.loops:
            self.loops.update(results)
            self._loop_reports()
            self._collect()
            return
        self._settled = False
        done: list[tuple[int, Any]] = []  # completed together: one advance per request
        for r in results:
            if r.error is None and not r.deferred:
                done.append((r.item, r.made))
                continue
            self.conductor.complete_all(done)  # in order with the failures
            done = []
            if r.error is not None:
                self.conductor.fail(r.item, r.error)
            else:
                self.conductor.defer(r.item)
        self.conductor.complete_all(done)
        self._collect()

    def fail_step(self, step: Step, error: str) -> None:
        """``update`` of ``step`` raised (a bug of ours, met by these requests' values): fail
        the runs it served and drop them, so that the rank serves the others on."""
        self._settled = False
        if step.external is not None:
            self._reports.append(
                NodeBatchDone(step.external, [ItemResult(it.id, error=error) for it in step.items])
            )
            return
        if step.loops:  # update may have taken some results: the runs still at the node
            run_ids = set(self.loops.requests_at(step.walk, step.node))
        else:
            run_ids = {getattr(it, "request", "") for it in step.items}
        for run_id in run_ids:
            run = self._runs.get(run_id)
            if run is None:
                continue
            self._reports.append(RegionFailed(run.item, error))
            self._by_request.get(run.request, set()).discard(run_id)
            if not self._by_request.get(run.request, True):
                del self._by_request[run.request]
            self._drop(run_id)

    def _loop_reports(self) -> None:
        """Hand the loop stepper's reports to the inner conductor (which may then have items
        ready: the rank is not settled, unless all it was told is stream items that formed no
        chunk and reach no client)."""
        for streamed, reps in itertools.groupby(
            self.loops.reports(), lambda r: isinstance(r, (LoopStreamed, LoopStreamedRows))
        ):
            if not streamed:
                for rep in reps:
                    self._settled = False
                    if isinstance(rep, LoopDone):
                        self.conductor.complete(rep.item, rep.channels)
                    else:
                        assert isinstance(rep, LoopFailed)
                        self.conductor.fail(rep.item, rep.error)
                continue
            # each run's channel's items at once (the fast lane's held ones: many steps')
            runs: dict[tuple[int, str], tuple[int, StepValues]] = {}
            group = cast("Iterator[LoopStreamed | LoopStreamedRows]", reps)  # the group's key
            for item, channel, index, values in streamed_items(group):
                at = runs.get((item, channel))
                if at is not None and at[0] + len(at[1]) == index:
                    at[1].add(values)
                    continue
                if at is not None:
                    self._streamed(item, channel, *at)
                runs[(item, channel)] = (index, StepValues(values))
            for (item, channel), at in runs.items():
                self._streamed(item, channel, *at)

    def _streamed(self, item: int, channel: str, index: int, values: Sequence[Any]) -> None:
        # items that only joined a stream buffer leave the rank settled: the fast lane steps
        # a producer feeding a windowed consumer until a window forms; so do items that only
        # became a client's stream items (its ``_collect`` makes them reports, which the
        # engine takes as the lane steps: ``reporting``)
        if self.conductor.streamed_run(item, channel, index, values):
            self._settled = False

    def reports(self) -> list[Report]:
        out, self._reports = self._reports, []
        return out

    def reporting(self) -> bool:
        """Whether reports wait (``reports``): the fast lane's steps may make some (a
        client's stream items) while the rank stays settled."""
        return bool(self._reports)

    def idle(self) -> bool:
        """Nothing to run: no live run, no node batch waiting."""
        return not self._runs and not self._external

    def stats(self) -> RankStats:
        c = self.conductor.stats()
        return RankStats(
            len(self._runs),
            c.live_values + self.loops.held(),
            c.speculated_steps,
            c.wasted_steps,
            dict(self.batch_sizes),
        )

    # ------------------------------------------------------------------ internals

    def _collect(self) -> None:
        """Turn the inner conductor's events into reports: outputs as soon as they exist
        (one ``RegionOutput`` per run and batch of events, always before a streamed item of
        the same run, so a client sees a prefill's token before the tokens after it)."""
        self.loops.drop(self.conductor.dropped())
        for credit in self.conductor.credits():  # fast loops feeding streams of their frame
            self.loops.credit(credit.request, credit.channel, credit.items)
        waiting: dict[str, _Run] = {}
        for run_id in self._fed_runs:  # how far consumers of fed streams are
            fed = self._runs[run_id]
            for stream, (base, closed) in self.conductor.fed_progress(run_id).items():
                now = (base, closed, fed.received.get(stream, 0))
                if fed.progress.get(stream) != now:
                    fed.progress[stream] = now
                    self._reports.append(RegionConsumed(fed.item, stream, base, now[2], closed))
        for event in self.conductor.events():
            run = self._runs.get(event.request)
            if run is None:
                continue
            if isinstance(event, Output):
                run.outputs[event.name] = event.value
                waiting[event.request] = run
                continue
            if isinstance(event, Finished):
                self._reports.append(RegionDone(run.item, run.outputs))
                waiting.pop(event.request, None)
                self._forget(event.request)
                continue
            if event.request in waiting:
                self._flush(waiting.pop(event.request))
            if isinstance(event, StreamItem):
                if event.channel in run.streamed:
                    self._reports.append(
                        RegionStreamed(run.item, event.channel, event.index, event.value)
                    )
            elif isinstance(event, Failed):
                self._reports.append(RegionFailed(run.item, event.error))
                self._forget(event.request)
        for run in waiting.values():
            self._flush(run)

    def _flush(self, run: _Run) -> None:
        self._reports.append(RegionOutput(run.item, run.outputs))
        run.outputs = {}

    def _forget(self, run_id: str) -> None:
        self._fed_runs.discard(run_id)
        self.loops.forget(run_id)
        run = self._runs.pop(run_id)
        runs = self._by_request.get(run.request)
        if runs is not None:
            runs.discard(run_id)
            if not runs:
                del self._by_request[run.request]

    def _drop(self, run_id: str) -> None:
        self.conductor.cancel(run_id)
        self.loops.drop(self.conductor.dropped())
        self.loops.forget(run_id)
        self._fed_runs.discard(run_id)
        self._runs.pop(run_id, None)


def _parts(group: Sequence[Runnable], size: int | None) -> list[list[Runnable]]:
    """``group`` cut into steps of at most ``size`` calls each (a map item holds several:
    ``WorkItem.calls``, as many as ``size`` at most), in order; None: one step."""
    if size is None:
        return [list(group)] if group else []
    parts: list[list[Runnable]] = []
    calls = 0
    for it in group:
        n = len(getattr(it, "calls", None) or (None,))
        if not parts or calls + n > size:
            parts.append([])
            calls = 0
        parts[-1].append(it)
        calls += n
    return parts
