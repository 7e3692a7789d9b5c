"""How runs of a simple loop share steps, for the loop stepper (``loopstep``): runs at the same
body node of a joinable loop become one runner item (``JoinedItem``: their calls concatenated,
``loopjoin``), and runs that can keep one joint state between steps step as a cohort
(``Band``: ``loopcohort``). ``SharedSteps`` is the stepper's part that forms, updates and
dissolves them; the stepper keeps the runs and the loop semantics."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.lowering.plan import NodePlan
from walkserve.runtime.cohortburst import burst
from walkserve.runtime.frames import piece_items
from walkserve.runtime.loopcohort import Cohort, Left, Member, extend, form, shrink
from walkserve.runtime.looprun import (
    LoopReport,
    LoopRun,
    LoopStreamed,
    LoopStreamedRows,
    SimpleLoop,
)
from walkserve.runtime.runner import ItemResult, LaneStep, RunItem

__all__ = ["Band", "JoinedItem", "SharedSteps"]

Call = tuple[list[Any], dict[str, Any]]


@dataclass(eq=False)
class JoinedItem:
    """A joined runner item: its runs, their rows of the batch dimension, the node."""

    runs: list[LoopRun]
    rows: list[int]
    pos: int


@dataclass(eq=False)
class Band:
    """A cohort (``loopcohort``) and the runs it steps, in its rows' order."""

    loop: SimpleLoop
    cohort: Cohort
    runs: list[LoopRun]
    streaming: list[tuple[int, LoopRun]]  # (row block, run) of the runs with a client's stream
    key: Any = None  # the join key of its runs' calls: a newcomer's must equal it to join
    streams: BandStreams | None = None  # how its steps' pieces are reported, while it holds


@dataclass(eq=False)
class BandStreams:
    """How a cohort's committed pieces are reported and counted, made once per cohort and
    set of live runs (``SharedSteps._band_streams``; a run that leaves drops it:
    ``_depart``) instead of once per step: per channel,
    the runs' ``(item, first iteration, offset, rows)`` and whether each gets the joint piece
    whole; per credited run's channel, the items a step adds (None: the joint piece says)."""

    cohort: Cohort
    channels: list[tuple[str, int, tuple[tuple[int, int, int, int], ...], bool]]
    counted: list[tuple[tuple[str, str], str, int | None]]
    keys: tuple[tuple[str, str], ...] = ()  # (request, channel) of each streaming run's streams


class SharedSteps:
    """Joined items and cohorts of a ``LoopStepper`` (its base: the state below is its)."""

    max_batch: int | None
    _runs: dict[int, LoopRun]
    _joined: dict[int, JoinedItem]
    _bands: list[Band]
    _banded: dict[int, Band]
    _credit: dict[tuple[str, str], int]
    _produced: dict[tuple[str, str], int]
    _ids: itertools.count[int]
    _reports: list[LoopReport]
    # the lane's quick commits not settled yet: their cohort, and the first of its steps
    # (``lane_burst``, ``lane_settle``)
    _quick: tuple[Band, int] | None
    _quick_sizes: tuple[tuple[str, int, int], ...]  # (value, dim, items) a quick step's piece has
    steps: int
    cohort_steps: int
    lane_steps: int

    def _item(
        self,
        groups: dict[tuple[str, str], list[RunItem]],
        run: LoopRun,
        node: NodePlan,
        call: Call | None,
    ) -> None:
        raise NotImplementedError

    def _begin(self, run: LoopRun) -> bool | None:
        raise NotImplementedError

    def _blocked(self, run: LoopRun) -> bool:
        raise NotImplementedError

    def _commit(self, run: LoopRun) -> None:
        raise NotImplementedError

    def _finish(self, run: LoopRun) -> None:
        raise NotImplementedError

    def _join(
        self,
        groups: dict[tuple[str, str], list[RunItem]],
        walk: str,
        members: list[tuple[LoopRun, tuple[list[Any], dict[str, Any]]]],
    ) -> None:
        first = members[0][0]
        node = first.loop.body[first.pos]
        if len(members) == 1:
            self._item(groups, first, node, members[0][1])
            return
        assert first.loop.join is not None
        call, rows = first.loop.join.join([c for _, c in members])
        rid = next(self._ids)
        self._joined[rid] = JoinedItem([r for r, _ in members], rows, first.pos)
        item = RunItem(rid, tuple(node.ops), {}, tuple(node.outputs), call, len(members))
        groups.setdefault((walk, node.name), []).append(item)

    # ------------------------------------------------------------------ cohorts

    def _cohort_ready(self, run: LoopRun) -> bool:
        return (
            run.loop.cohort is not None
            and not run.alone
            and not run.solo
            and run.pos == 0
            and not self._blocked(run)  # its consumers' credit allows one more item
        )

    def _regroup(self) -> None:
        """Dissolve the cohorts that lost a run (cancelled) or hold one that its consumers'
        credit stops. (A new run of their loop joins them: ``_extend``.)"""
        for band in list(self._bands):
            if any(r.item not in self._runs or not self._cohort_ready(r) for r in band.runs):
                self._dissolve(band)

    def _extend_bands(
        self, key: Any, members: list[tuple[LoopRun, Call]]
    ) -> list[tuple[LoopRun, Call]]:
        """Let the cohorts of ``members``' loop whose runs' calls share their join ``key``
        take them in, as many as ``max_batch`` allows; the members none took."""
        loop = members[0][0].loop
        for band in self._bands:
            if not members:
                break
            if band.loop is not loop or band.key != key:
                continue
            room = len(members) if self.max_batch is None else self.max_batch - len(band.runs)
            if room > 0 and self._extend(band, members[:room]):
                members = members[room:]
        return members

    def _extend(self, band: Band, members: list[tuple[LoopRun, Call]]) -> bool:
        """``band``'s cohort with ``members`` joined after its runs (``loopcohort.extend``);
        its runs keep the pieces of the steps they took so far and count them. False (nothing
        changed) when one of them cannot be held."""
        join = band.loop.join
        if join is None or not all(self._cohort_ready(r) for r, _ in members):
            return False
        old = band.cohort
        cohort = extend(old, [Member(r.start, r.i, r.carried, join._rows(c)) for r, c in members])
        if cohort is None:
            return False
        if old.steps:
            for run, pieces in zip(band.runs, old.seal()):
                _stays(run, pieces, old.steps)
        band.cohort = cohort
        for run, _ in members:
            run.band = band
            band.runs.append(run)
        band.streaming = [(k, r) for k, r in enumerate(band.runs) if r.start.streams]
        return True

    def _band(self, members: list[tuple[LoopRun, Call]], key: Any = None) -> bool:
        """Form a cohort of ``members`` (their first calls share one join ``key``); False when
        their loop keeps none or one of them cannot be held (then they join call by call)."""
        loop = members[0][0].loop
        if loop.cohort is None or loop.join is None:
            return False
        if not all(self._cohort_ready(r) for r, _ in members):
            return False
        join = loop.join
        cohort = form(
            loop.cohort, [Member(r.start, r.i, r.carried, join._rows(c)) for r, c in members]
        )
        if cohort is None:
            for run, _ in members:
                run.solo = True
            return False
        runs = [r for r, _ in members]
        streaming = [(k, r) for k, r in enumerate(runs) if r.start.streams]
        band = Band(loop, cohort, runs, streaming, key)
        for run in band.runs:
            run.band = band
        self._bands.append(band)
        return True

    def _band_item(self, groups: dict[tuple[str, str], list[RunItem]], band: Band) -> None:
        node = band.loop.body[0]
        rid = next(self._ids)
        self._banded[rid] = band
        item = RunItem(
            rid, tuple(node.ops), {}, tuple(node.outputs), band.cohort.call(), len(band.runs)
        )
        groups.setdefault((band.loop.walk, node.name), []).append(item)

    def _update_band(self, band: Band, r: ItemResult) -> None:
        if band not in self._bands:
            return
        if r.error is not None:
            self._dissolve(band, alone=True)  # each again by itself: the bad request fails alone
            return
        if r.deferred:
            return
        assert r.values is not None
        cohort = band.cohort
        if not cohort.advance(r.values):
            self._dissolve(band, alone=True)  # not batched as captured: each run by itself
            return
        if band.streaming:
            self._band_streamed(band)
        if cohort.done():
            self._shrink(band)

    def _band_streamed(self, band: Band, step: int | None = None) -> None:
        """Each streaming run's piece of its streams' channels from the cohort's step
        ``step`` (None: the one just committed): one ``LoopStreamedRows`` per channel when
        the runs' rows are cut out of one joint piece (cut later, many steps at once), else a
        ``LoopStreamed`` each; and the items each credited run produced."""
        cohort = band.cohort
        plan = self._streams_plan(band)
        if step is None:
            step = cohort.steps - 1
        pieces = cohort.pieces
        for ch, dim, layout, whole in plan.channels:
            last = pieces[ch][step]
            if whole:  # one piece for all: the joint one
                self._reports += [LoopStreamed(it, ch, i + step, last) for it, i, _, _ in layout]
            else:
                self._reports.append(LoopStreamedRows(ch, dim, layout, step, last))
        if not self._credit:
            return
        credit, produced, accumulated = self._credit, self._produced, band.loop.node.accumulated
        joint: dict[str, int] = {}  # a channel's items in the joint piece, each run's too
        for key, ch, n in plan.counted:  # counted as the stepper's own runs count it
            if key in credit:
                if n is None:
                    n = joint.get(ch)
                    if n is None:
                        n = joint[ch] = piece_items(pieces[ch][step], accumulated[ch])
                produced[key] = produced.get(key, 0) + n

    # ------------------------------------------------------------------ quick lane commits

    def lane_budget(self, band: Band, held: Collection[tuple[int, str]]) -> int:
        """How many of ``band``'s next steps the engine's lane may commit with ``lane_burst``
        (0: none): steps whose commits change nothing but the cohort. ``band`` is the lone
        cohort; its last step (which shrinks or dissolves it) is not among them; every channel
        its runs stream is in ``held`` (its items may wait for the lane's end: the step is
        not reported before ``lane_settle``); and no credited run reaches its credit in them
        (``lane_open`` after each would say the lane goes on)."""
        self._quick_sizes = ()  # this budget's, set below where it counts a piece's size
        if len(self._bands) != 1 or self._bands[0] is not band:
            return 0
        cohort = band.cohort
        budget = cohort.length - cohort.steps - 1
        if budget < 1 or not band.streaming:
            return max(budget, 0)
        if any((run.item, ch) not in held for _, run in band.streaming for ch in run.start.streams):
            return 0
        plan = self._streams_plan(band)
        credit, produced, spec = self._credit, self._produced, cohort.spec
        sizes: dict[str, tuple[str, int, int]] = {}
        for key, ch, n in plan.counted:
            allowed = credit.get(key)
            if allowed is None:
                continue
            if n is None:  # its items are read off each step's piece: this one's, and each
                # quick step checks its own has as many (``lane_burst``)
                last, acc = cohort.pieces[ch][-1], band.loop.node.accumulated[ch]
                if not isinstance(last, torch.Tensor) or acc.mode != "cat":
                    return 0
                n = piece_items(last, acc)
                name = spec.outputs[spec.accumulated[ch]]
                sizes[ch] = (name, acc.dim % last.dim(), n)
            if n < 1:
                return 0
            # after j more steps the next may start while produced + j * n + 1 <= allowed
            budget = min(budget, (allowed - 1 - produced.get(key, 0)) // n)
        self._quick_sizes = tuple(sizes.values()) if budget > 0 else ()
        return max(budget, 0)

    def lane_burst(
        self, band: Band, step: LaneStep, limit: int, stop: Callable[[], bool]
    ) -> tuple[int, Any, bool]:
        """Up to ``limit`` (within ``lane_budget``) steps of ``band`` back to back, each
        ``step``'s values committed at once into the cohort (``cohortburst.burst``), their
        reports and counts kept for ``lane_settle``; ``stop()`` is asked after each. How many it
        committed, the result of a step it did not commit (None if none: anything but a good
        step's values, such as a failure, a deferral, values not batched as captured or a piece
        of another size than the budget counted; ``lane_step`` commits that one, after
        ``lane_settle``), and whether it ended on ``stop()``."""
        accept = None
        if self._quick_sizes:
            sizes = self._quick_sizes

            def accept(values: Mapping[str, Any]) -> bool:  # pieces of the size it counted
                for name, dim, n in sizes:
                    piece = values.get(name)
                    if (
                        not isinstance(piece, torch.Tensor)
                        or piece.dim() <= dim
                        or piece.shape[dim] != n
                    ):
                        return False
                return True

        first = band.cohort.steps
        made, left, stopped = burst(band.cohort, step, limit, stop, accept)
        if made and self._quick is None:
            self._quick = (band, first)
        return made, left, stopped

    def lane_settle(self) -> int:
        """What ``lane_step`` would have done for each quick commit since the last settle (in
        step order: its reports, its credited runs' items, the steps counted): how many."""
        if self._quick is None:
            return 0
        band, first = self._quick
        self._quick = None
        n = band.cohort.steps - first
        self.steps += n
        self.cohort_steps += n
        self.lane_steps += n
        if band.streaming:
            for step in range(first, band.cohort.steps):
                self._band_streamed(band, step)
        return n

    def _streams_plan(self, band: Band) -> BandStreams:
        """``band``'s stream plan, made again where its cohort or live runs changed."""
        plan = band.streams
        if plan is None or plan.cohort is not band.cohort:
            plan = band.streams = self._band_streams(band)
        return plan

    def _band_streams(self, band: Band) -> BandStreams:
        cohort, spec = band.cohort, band.cohort.spec
        whole = len(cohort.rows) == 1
        by_channel: dict[str, list[tuple[int, int, int, int]]] = {}
        dims: dict[str, int | None] = {}
        counted: list[tuple[tuple[str, str], str, int | None]] = []
        keys: list[tuple[str, str]] = []
        for k, run in band.streaming:
            if run.item not in self._runs:
                continue
            keys += [(run.request, ch) for ch in run.start.streams]
            for ch in run.start.streams:  # a client's stream: each commit's piece, as it is made
                if ch not in spec.accumulated:
                    continue
                if ch not in dims:
                    dims[ch] = spec.out_dims[spec.outputs[spec.accumulated[ch]]]
                dim = dims[ch]
                by_channel.setdefault(ch, []).append(
                    (run.item, run.i, cohort.offsets[k], cohort.rows[k])
                )
                # the items of its rows of a piece: one (stack), or their length along the
                # dim (cat): its rows' count where the rows are cut along it, else the joint
                # piece's length there (None: read off each step's piece)
                acc, last = band.loop.node.accumulated[ch], cohort.pieces[ch][-1]
                n: int | None = None
                if acc.mode == "stack" or not isinstance(last, torch.Tensor):
                    n = 1
                elif not whole and dim is not None and dim == acc.dim % last.dim():
                    n = cohort.rows[k]
                counted.append(((run.request, ch), ch, n))
        channels = []
        for ch, runs in by_channel.items():
            dim = dims[ch]  # None: not batched, every run gets the joint piece whole
            channels.append((ch, -1 if dim is None else dim, tuple(runs), dim is None or whole))
        return BandStreams(cohort, channels, counted, tuple(keys))

    def _depart(self, item: int) -> None:
        """Take run ``item`` out of the live runs (dropped, failed or finished); the cohort it
        is in plans its streams again without it."""
        run = self._runs.pop(item, None)
        if run is not None and run.band is not None:
            run.band.streams = None

    def _shrink(self, band: Band) -> None:
        """``band`` at its length: the runs with iterations left go on as a cohort of their
        rows (``loopcohort.shrink``), the others leave as ``_dissolve`` lets them; all of it
        dissolves where that cohort cannot be made."""
        old = band.cohort
        going = {
            k: Member(r.start, r.i + old.steps, {}, old.rows[k])
            for k, r in enumerate(band.runs)
            if r.item in self._runs and r.i + old.steps < r.start.bound
        }
        rest = None
        if 0 < len(going) < len(band.runs):
            rest = shrink(old, list(going), list(going.values()))
        if rest is None:
            self._dissolve(band)
            return
        runs, band.runs = band.runs, [band.runs[k] for k in going]
        band.cohort = rest
        band.streaming = [(k, r) for k, r in enumerate(band.runs) if r.start.streams]
        for k, (run, pieces) in enumerate(zip(runs, old.seal())):
            if k in going:
                _stays(run, pieces, old.steps)
                continue
            run.band = None
            if run.item in self._runs:
                self._leave(run, old.left(k, pieces))

    def _dissolve(self, band: Band, alone: bool = False) -> None:
        """Give each run of ``band`` its rows of the cohort's state; those at their bound
        finish, the others go on as the stepper's own runs."""
        self._bands.remove(band)
        rebased = band.cohort.rebased  # runs whose carried values are the cohort's already
        for k, (run, left) in enumerate(zip(band.runs, band.cohort.dissolve())):
            run.band = None
            if run.item not in self._runs:
                continue
            run.alone = alone
            # a run that took no step here keeps its own state, unless it took its steps in
            # the cohort this one was extended from (its carried values are the joint ones)
            if left.steps or k < rebased:
                self._leave(run, left)

    def _leave(self, run: LoopRun, left: Left) -> None:
        """``run`` out of its cohort with ``left``, its rows of the cohort's state: it keeps
        its pieces and goes on by itself from its next iteration, or finishes at its bound."""
        for ch, pieces in run.collected.items():
            pieces.extend(left.pieces.get(ch, ()))
        run.carried, run.i = left.carried, run.i + left.steps
        if left.last is not None:  # None: no step taken here (its own last outputs stand)
            run.last = left.last
        if self._begin(run) is False:
            self._finish(run)

    def _update_joined(self, joined: JoinedItem, r: ItemResult) -> None:
        runs = [run for run in joined.runs if run.item in self._runs and run.pos == joined.pos]
        if r.error is not None:
            for run in runs:  # each again by itself: the bad request fails alone
                run.alone = True
            return
        if r.deferred or not runs:
            return
        assert r.values is not None and runs[0].loop.join is not None
        parts = runs[0].loop.join.split(r.values, joined.rows)
        if parts is None:
            for run in runs:  # a value not batched as captured: each run by itself
                run.alone = True
            return
        index = {id(run): k for k, run in enumerate(joined.runs)}
        for run in runs:
            k = index[id(run)]
            env = run.env
            for name, values in parts.items():
                env[name] = values[k]
            run.pos += 1
            if run.pos == len(run.loop.body):
                self._commit(run)


def _stays(run: LoopRun, pieces: dict[str, list[Any]], steps: int) -> None:
    """``run`` stays in its cohort as the cohort changes its rows: it keeps the ``pieces`` of
    the ``steps`` it took so far and counts them."""
    for ch, collected in run.collected.items():
        collected.extend(pieces.get(ch, ()))
    run.i += steps
