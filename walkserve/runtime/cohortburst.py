"""A cohort's steps back to back: the fast lane's quick commits made in one loop.

Between two steps of a lone cohort whose commits change nothing but the cohort
(``LoopStepper.lane_budget``), all the lane does is what ``Cohort.call``, the runner's step and
``Cohort.advance`` do. Made one step at a time through the lane's closures (a result object, a
commit, the scheduler's checks), that Python cost the rollout of ``bench_loops`` (a small MLP,
~90-100 us a step eagerly on the 2-core VM) 13-18 us a step over its eager loop: work between
two model calls costs several times what it costs alone, its data evicted by the model's.
``burst`` makes those steps in one loop over local values::

    n, left, stopped = burst(cohort, step, limit, stop)

where the places of the call's arguments are resolved once, each step's per-step slices and
carried values are put where the next call reads them, its accumulated pieces kept in a list,
and the cohort is written back once when the loop ends: the same state, step for step, as
``advance`` after each (``tests/unit/test_cohort_burst.py``). A step whose values ``advance``
would refuse, or that ``accept`` refuses, or whose ``step`` says something other than values (a
failure, a deferral) is handed back uncommitted as ``left``, for the lane's full commit.

Measured (alternated with the lane before, a 2000-step rollout served on one rank, the paired
per-step difference to eager): 13-14 us -> 8 us a step, 4.9-10.8 against 23-24 us (a slower
hour of the VM) with the rank link's ``doorbell`` read between steps instead of a poll of its
socket. In one process (``EngineLoop`` with no sockets), 10.5 -> 4.6 us a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from walkserve.runtime.loopcohort import ARG_CARRIED, ARG_STEP, Cohort
from walkserve.runtime.runner import LaneStep

__all__ = ["burst"]


def burst(
    cohort: Cohort,
    step: LaneStep,
    limit: int,
    stop: Callable[[], bool],
    accept: Callable[[Mapping[str, Any]], bool] | None = None,
) -> tuple[int, Any, bool]:
    """Up to ``limit`` steps of ``cohort``, each ``step(args, kwargs)`` on that step's
    arguments (``Cohort.call``'s) and committed as ``Cohort.advance`` commits it, ``stop()``
    asked after each committed step: how many it committed, the result of the step it did not
    commit (None if none), and whether it ended on ``stop()``."""
    if limit < 1:
        return 0, None, False
    spec = cohort.spec
    args_plan, kw_plan = spec.plan
    args, kwargs = cohort.call()  # the first step's; then each step's slices, carried values
    out_of = dict(spec.carried)  # a carried parameter's loop output
    carry = [(i, out_of[v]) for i, (k, v) in enumerate(args_plan) if k == ARG_CARRIED]
    carry_kw = [(name, out_of[v]) for name, k, v in kw_plan if k == ARG_CARRIED]
    sliced = [(i, v) for i, (k, v) in enumerate(args_plan) if k == ARG_STEP]
    sliced_kw = [(name, v) for name, k, v in kw_plan if k == ARG_STEP]
    per_step = bool(sliced or sliced_kw)
    outputs = cohort.outputs
    acc = list(spec.accumulated.items())  # (channel, loop output)
    made: list[list[Any]] = [[] for _ in acc]  # this burst's pieces, by channel
    i, n, left, stopped = cohort.steps, 0, None, False
    outs: list[Any] = []
    views: Mapping[str, Any] = {}
    j = cut = 0  # this step's index in ``views``, and the views left from it
    try:
        while n < limit:
            if per_step:
                if not cut:
                    views, j = cohort.views(i)
                    cut = len(next(iter(views.values()))) - j
                for at, p in sliced:
                    args[at] = views[p][j]
                for name, p in sliced_kw:
                    kwargs[name] = views[p][j]
            values = step(args, kwargs)
            if type(values) is not dict or (accept is not None and not accept(values)):
                left = values
                break
            now = outputs(values)  # ``Cohort.advance``'s rule
            if now is None:
                left = values
                break
            outs = now
            for pieces, (_, k) in zip(made, acc):
                pieces.append(outs[k])
            for at, k in carry:
                args[at] = outs[k]
            for name, k in carry_kw:
                kwargs[name] = outs[k]
            n += 1
            i += 1
            j += 1
            cut -= 1
            if stop():
                stopped = True
                break
    finally:
        if n:  # the cohort as ``advance`` would have left it after the last committed step
            for pieces, (ch, _) in zip(made, acc):
                cohort.pieces.setdefault(ch, []).extend(pieces)
            cohort.carried = {p: outs[k] for p, k in spec.carried}
            cohort.last = outs
            cohort.steps = i
    return n, left, stopped
