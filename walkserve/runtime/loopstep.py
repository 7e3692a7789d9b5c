"""The loop stepper: a rank's fast path for simple loops, many requests at a time.

Pure, like the rank scheduler it serves. A *simple* loop is one whose body is a straight run of
plan nodes (no nested loop, no stream in or out, no chunk parameter): a decode step, a rollout
step, a flow-matching step. The conductor inside a rank hands such a loop over as one item
(``kind="loop"``, its start values in ``WorkItem.loop``) instead of a frame per iteration, and
the stepper keeps, per run, only what the loop semantics need (``capture.loopsem``: the
iteration index, carried values, accumulations, the stop)::

    stepper.start(item)                  # a loop item of the rank's conductor
    for step in stepper.schedule():      # every run at each body node, one step per node
        stepper.update(step, runner.run(step.walk, step.node, step.items))
    stepper.reports()                    # LoopStreamed(Rows) (per commit), LoopDone, LoopFailed

Runs at different iterations share a step (continuous batching); a run leaves when its bound
or its stop says so, and its stop is read the moment its step's values exist, so nothing is
speculated here. A component that answers ``DEFER`` (no KV memory now) has that run retry the
node at the next step.

Joined steps: runs at the same body node of a *joinable* loop (its body one component node
whose glue only unpacks the component's tuple, a plain batched callable: no ``forward_batch``)
whose arguments the component would batch together (``BatchedComponent._groups``: batched
tensors alike but for the batch dimension, other arguments equal) become one runner item, its
arguments already concatenated (``RunItem.joined``: how many runs it holds), and its outputs are
split back per run (``loopshare``). Nothing per run crosses the runner. Cohorts go further:
runs of a loop that can keep one joint state between steps (``loopcohort``) are concatenated
once and stepped as one until one of them leaves, so that a step of 16 requests costs little
more than a step of one. When a joined or cohort call raises, its runs take that node again one
by one at the next step, so that a bad request fails alone (the runner's failure rule).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from walkserve.capture import ir
from walkserve.capture.loopsem import LoopError, loop_channels, truth
from walkserve.lowering.plan import NodePlan
from walkserve.runtime.conductor import WorkItem, piece_items
from walkserve.runtime.looprun import (
    LoopCompiler,
    LoopDone,
    LoopFailed,
    LoopReport,
    LoopRun,
    LoopStreamed,
    LoopStreamedRows,
    loop_plans,
    streamed_items,
)
from walkserve.runtime.loopshare import Band, JoinedItem, SharedSteps
from walkserve.runtime.regionwalk import RegionWalks
from walkserve.runtime.runner import ItemResult, RunItem

__all__ = [
    "LoopDone",
    "LoopFailed",
    "LoopStepper",
    "LoopStreamed",
    "LoopStreamedRows",
    "loop_plans",
    "streamed_items",
]


class LoopStepper(SharedSteps):
    """See the module docstring."""

    def __init__(
        self,
        regions: RegionWalks,
        *,
        max_batch: int | None = None,
        joins: Collection[tuple[str, str]] = (),
        cohorts: bool = True,
    ) -> None:
        """``joins``: the (walk, node) whose calls the runner takes joined
        (``NodeRunner.joinable()``); ``max_batch``: most runs in one joined item; ``cohorts``:
        joined runs keep one joint state between steps (``loopcohort``)."""
        self.regions = regions
        self.max_batch = max_batch
        self._compiler = LoopCompiler(regions, joins, cohorts)
        self._runs: dict[int, LoopRun] = {}
        self._waiting: dict[int, tuple[LoopRun, int]] = {}  # runner item id -> (run, body pos)
        self._joined: dict[int, JoinedItem] = {}  # runner item id -> the runs it joined
        self._bands: list[Band] = []
        self._banded: dict[int, Band] = {}  # runner item id -> the cohort it steps
        self._ids = itertools.count()
        self._reports: list[LoopReport] = []
        self._credit: dict[tuple[str, str], int] = {}  # (request, channel) -> items allowed
        self._produced: dict[tuple[str, str], int] = {}
        self.steps = 0
        self.cohort_steps = 0  # runner items of cohorts (one per cohort per step)
        self.joined_steps = 0  # runner items of runs joined call by call
        self.lane_steps = 0  # cohort steps of the engine's fast lane (lane_step)
        self._quick = None  # the lane's quick commits not settled yet (``lane_burst``)
        self._quick_sizes = ()

    def start(self, item: WorkItem) -> None:
        assert item.loop is not None
        loop = self._compiler.compile(item.walk, item.loop.loop)
        run = LoopRun(item.id, item.request, loop, item.loop, carried=dict(item.loop.carried))
        run.collected = {ch: [] for ch in item.loop.channels if ch in loop.node.accumulated}
        self._runs[item.id] = run
        if self._begin(run) is False:
            self._finish(run)

    def credit(self, request: str, channel: str, items: int) -> None:
        """Loops of ``request`` may commit items of ``channel`` up to ``items`` (counting the
        iteration in flight as one): a forwarded stream's backpressure."""
        self._credit[(request, channel)] = items

    def forget(self, request: str) -> None:
        for key in [k for k in self._credit if k[0] == request]:
            del self._credit[key]
            self._produced.pop(key, None)

    def _blocked(self, run: LoopRun) -> bool:
        return self._over_credit([(run.request, ch) for ch in run.start.streams])

    def _over_credit(self, keys: Iterable[tuple[str, str]]) -> bool:
        """Whether one more item of any of ``keys`` (request, channel) is beyond its credit."""
        credit, produced = self._credit, self._produced
        for key in keys:
            allowed = credit.get(key)
            if allowed is not None and produced.get(key, 0) + 1 > allowed:
                return True
        return False

    def describe(self, item_id: int) -> tuple[str, int] | None:
        """(request, iteration) of a runner item the last ``schedule`` made (of its first run,
        for a joined item)."""
        found = self.members(item_id)
        return found[0] if found else None

    def members(self, item_id: int) -> list[tuple[str, int]]:
        """(request, iteration) of each run in a runner item the last ``schedule`` made."""
        found = self._waiting.get(item_id)
        if found is not None:
            return [(found[0].request, found[0].i)]
        band = self._banded.get(item_id)
        if band is not None:
            return [(r.request, r.i + band.cohort.steps) for r in band.runs]
        joined = self._joined.get(item_id)
        return [] if joined is None else [(r.request, r.i) for r in joined.runs]

    def requests_at(self, walk: str, node: str) -> list[str]:
        """The requests of the runs waiting at body node ``node`` of ``walk``, or caught
        between their last node and their commit."""
        return [
            r.request
            for r in self._runs.values()
            if r.loop.walk == walk
            and (r.pos >= len(r.loop.body) or r.loop.body[r.pos].name == node)
        ]

    def drop(self, items: Sequence[int]) -> None:
        for item in items:
            self._depart(item)

    def idle(self) -> bool:
        return not self._runs

    def live(self) -> int:
        return len(self._runs)

    def held(self) -> int:
        """Values the live runs hold (their body values, carried values, accumulations)."""
        return sum(
            len(r.env) + len(r.carried) + sum(len(v) for v in r.collected.values())
            for r in self._runs.values()
        ) + sum(b.cohort.held() for b in self._bands)

    def counters(self) -> dict[str, int]:
        """Steps by how they ran, for a rank's stats: a cohort's, or runs joined call by call."""
        return {
            "loop_stepper/cohort_steps": self.cohort_steps,
            "loop_stepper/joined_steps": self.joined_steps,
            "loop_stepper/lane_steps": self.lane_steps,
        }

    def reports(self) -> list[LoopReport]:
        out, self._reports = self._reports, []
        return out

    # ------------------------------------------------------------------ the loop

    def schedule(self) -> list[tuple[str, str, list[RunItem]]]:
        """(walk, node, items): every live run at its body node, one group per node (runs of
        a joinable loop that can share a call as one joined item)."""
        self._waiting.clear()
        self._joined.clear()
        self._banded.clear()
        self._regroup()
        groups: dict[tuple[str, str], list[RunItem]] = {}
        joins: dict[tuple[Any, ...], list[tuple[LoopRun, tuple[list[Any], dict[str, Any]]]]] = {}
        for run in list(self._runs.values()):
            if run.band is not None:
                continue
            if run.pos == 0 and self._credit and self._blocked(run):
                continue  # its consumers' buffers are full: it waits for their credit
            loop = run.loop
            node = loop.body[run.pos]
            call = None
            if node.kind == "component":
                args, kwargs = loop.calls[node.name]
                env = run.env
                try:
                    call = ([get(env) for get in args], {k: get(env) for k, get in kwargs})
                except Exception as e:
                    self._fail(run, f"node {node.name}: {e}")
                    continue
                if loop.join is not None and not run.alone:
                    key = loop.join.key(call)
                    if key is not None:
                        joins.setdefault((loop.walk, node.name, key), []).append((run, call))
                        continue
                    run.solo = True  # a call no cohort can hold: it must not dissolve others
            self._item(groups, run, node, call)
        for (walk, _node, key), members in joins.items():
            members = self._extend_bands(key, members)
            size = self.max_batch or len(members) or 1
            for k in range(0, len(members), size):
                part = members[k : k + size]
                if not self._band(part, key):
                    self._join(groups, walk, part)
        for band in self._bands:
            self._band_item(groups, band)
        self.steps += bool(groups)
        self.cohort_steps += len(self._banded)
        self.joined_steps += len(self._joined)
        return [(walk, node, items) for (walk, node), items in groups.items()]

    def lane(self) -> Band | None:
        """The cohort the engine's fast lane may step back to back (``lane_step``): when all
        this stepper runs is that one cohort (streaming or not; none of its runs stopped by its
        consumers' credit) and its last step was updated, so that its next step is what
        ``schedule`` would make now (nothing waits, nothing joins or dissolves it); else None."""
        if len(self._bands) != 1 or self._waiting or self._joined or self._banded:
            return None
        band = self._bands[0]
        if len(band.runs) != len(self._runs) or not all(map(self._cohort_ready, band.runs)):
            return None  # a run outside it, or one its consumers' credit now limits
        return band

    def lane_of(self, item_id: int) -> Band | None:
        """The lone cohort whose step ``schedule`` just handed out as runner item ``item_id``
        (that step alone), taken back for the fast lane, which makes that step as its first
        (and counts it); None, nothing taken back, where ``lane`` would not give it."""
        band = self._banded.pop(item_id, None)
        if band is None:
            return None
        if self.lane() is not band:
            self._banded[item_id] = band
            return None
        self.steps -= 1  # schedule's count of it: lane_step counts it
        self.cohort_steps -= 1
        return band

    def lane_item(self, band: Band) -> RunItem:
        """The runner item of ``band``'s steps, less its call (each step's is
        ``band.cohort.call()``)."""
        node = band.loop.body[0]
        return RunItem(-1, tuple(node.ops), {}, tuple(node.outputs), None, len(band.runs))

    def lane_step(self, band: Band, result: ItemResult) -> bool:
        """Commit the runner's result for ``band``'s step (the lane's); whether the lane may
        take the next one: ``band`` still the lone cohort, no run of it stopped by credit."""
        self.steps += 1
        self.cohort_steps += 1
        self.lane_steps += 1
        self._update_band(band, result)
        return self.lane_open(band)

    def lane_open(self, band: Band) -> bool:
        """Whether the lane may step ``band`` on: still the lone cohort, no run of it stopped
        by credit."""
        if len(self._bands) != 1 or self._bands[0] is not band:
            return False  # dissolved: at its length, or a failed or unbatched step
        if not self._credit:
            return True
        plan = band.streams
        if plan is None or plan.cohort is not band.cohort:
            return not any(map(self._blocked, band.runs))
        return not self._over_credit(plan.keys)  # ``_blocked`` of each streaming run, at once

    def reporting(self) -> bool:
        """Whether reports wait (``reports``)."""
        return bool(self._reports)

    def waiting_reports(self) -> int:
        """How many reports wait (``reports``)."""
        return len(self._reports)

    def urgent(
        self,
        since: int,
        held: Collection[tuple[int, str]],
        seen: dict[int, tuple[Any, bool]] | None = None,
    ) -> bool:
        """Whether a report waits, from the ``since``-th on, that is not a streamed item of a
        (run, channel) in ``held`` (which may wait for a later ``reports``). ``seen``: the
        answers for rows reports' run layouts so far (a cohort's steps share one), by the
        layout's id, kept by a caller whose ``held`` does not change."""
        for rep in self._reports[since:]:
            if isinstance(rep, LoopStreamed):
                if (rep.item, rep.channel) not in held:
                    return True
                continue
            if not isinstance(rep, LoopStreamedRows):
                return True
            known = seen.get(id(rep.runs)) if seen is not None else None
            if known is not None and known[0] is rep.runs:
                if known[1]:
                    return True
                continue
            ch = rep.channel
            out = any((item, ch) not in held for item, _, _, _ in rep.runs)
            if seen is not None:
                seen[id(rep.runs)] = (rep.runs, out)
            if out:
                return True
        return False

    def _item(
        self,
        groups: dict[tuple[str, str], list[RunItem]],
        run: LoopRun,
        node: NodePlan,
        call: tuple[list[Any], dict[str, Any]] | None,
    ) -> None:
        rid = next(self._ids)
        self._waiting[rid] = (run, run.pos)
        item = RunItem(rid, tuple(node.ops), run.env, tuple(node.outputs), call)
        groups.setdefault((run.loop.walk, node.name), []).append(item)

    def update(self, results: Sequence[ItemResult]) -> None:
        for r in results:
            band = self._banded.pop(r.item, None)
            if band is not None:
                self._update_band(band, r)
                continue
            joined = self._joined.pop(r.item, None)
            if joined is not None:
                self._update_joined(joined, r)
                continue
            run, pos = self._waiting.pop(r.item, (None, -1))
            if run is None or run.item not in self._runs or pos != run.pos:
                continue
            if r.error is not None:
                self._fail(run, r.error)
                continue
            if r.deferred:
                continue  # the same node again at the next step
            assert r.values is not None
            run.alone = False
            run.env.update(r.values)
            run.pos += 1
            if run.pos == len(run.loop.body):
                self._commit(run)

    # ------------------------------------------------------------------ internals

    def _begin(self, run: LoopRun) -> bool | None:
        """Set up iteration ``run.i``'s body values; False when the loop is done, None when
        the run failed (a per-step input the request's values cannot give: reported)."""
        if run.i >= run.start.bound:
            return False
        i, start = run.i, run.start
        env = dict(start.fixed)
        env.update(run.carried)
        for name, first, step in run.loop.affine:
            env[name] = first + i * step
        try:
            for name, dim, first, step in run.loop.select:
                env[name] = start.sources[name].select(dim, first + i * step)
            for name in run.loop.table:
                env[name] = start.sources[name][i]
        except (IndexError, RuntimeError, TypeError) as e:  # the request's values, not the rank
            self._fail(run, f"loop {run.loop.node.name} iteration {i}: {e}")
            return None
        run.env, run.pos = env, 0
        return True

    def _commit(self, run: LoopRun) -> None:
        node = run.loop.node
        env = run.env
        try:
            outs = [env[o] for o in node.outputs]
        except KeyError as e:
            self._fail(run, f"loop {node.name}: its body made no value {e}")
            return
        for ch, acc in node.accumulated.items():
            piece = outs[acc.output]
            if ch in run.collected:
                run.collected[ch].append(piece)
            if ch in run.start.streams:  # a client's stream, or one of its frame's streams
                self._reports.append(LoopStreamed(run.item, ch, run.i, piece))
                key = (run.request, ch)
                if key in self._credit:
                    self._produced[key] = self._produced.get(key, 0) + piece_items(piece, acc)
        run.carried = {p: outs[k] for p, k in run.loop.carried}
        run.last = outs
        run.i += 1
        try:
            stop = node.stop is not None and truth(env[node.stop], node)
        except LoopError as e:
            self._fail(run, str(e))
            return
        if stop or self._begin(run) is False:
            self._finish(run)

    def _finish(self, run: LoopRun) -> None:
        node = run.loop.node
        self._depart(run.item)
        if run.i == 0 and node.accumulated:  # as the interpreter and the conductor
            ch = next(iter(node.accumulated))
            self._reports.append(
                LoopFailed(run.item, f"loop {node.name} ran no iteration, so {ch} is empty")
            )
            return
        visible = {ch: a for ch, a in node.accumulated.items() if ch in run.collected}
        spec = ir.LoopNode(
            node.name, node.body, node.params, node.outputs, node.terminal, visible, node.trips
        )
        try:
            channels = loop_channels(spec, run.carried, run.last, run.collected)
        except LoopError as e:
            self._reports.append(LoopFailed(run.item, str(e)))
            return
        self._reports.append(
            LoopDone(run.item, {ch: v for ch, v in channels.items() if ch in run.start.channels})
        )

    def _fail(self, run: LoopRun, error: str) -> None:
        self._depart(run.item)
        self._reports.append(LoopFailed(run.item, error))
