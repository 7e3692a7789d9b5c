"""``cohortburst.burst`` against the cohort stepped one ``call`` and ``advance`` at a time: the
same calls, the same steps committed, the same step handed back, the same cohort after."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.cohortburst import burst
from walkserve.runtime.loopcohort import Cohort, CohortSpec

NAMES = ("x", "a", "w", "c")  # carried, a per-step slice, invariant, a constant


def make_cohort(rows: int, length: int, positional: int, seed: int) -> Cohort:
    """A cohort of ``rows`` rows and ``length`` steps whose component takes ``NAMES``, the
    first ``positional`` of them by position and the others by name."""
    kinds = {"x": ("param", "x"), "a": ("param", "a"), "w": ("param", "w"), "c": ("const", 0.25)}
    spec = CohortSpec(
        args=tuple(kinds[n] for n in NAMES[:positional]),
        kwargs=tuple((n, kinds[n]) for n in NAMES[positional:]),
        param_dims={"x": 0, "a": 0, "w": 0},
        carried=(("x", 0),),
        select={"a": (1, 0, 1)},
        outputs=("y", "g"),
        out_dims={"y": 0, "g": 0},
        accumulated={"ys": 0, "gs": 1},
    )
    g = torch.Generator().manual_seed(seed)
    return Cohort(
        spec,
        [rows],
        length,
        fixed={"w": torch.randn(rows, 1, generator=g)},
        carried={"x": torch.randn(rows, 3, generator=g)},
        slabs={"a": torch.randn(rows, length, 2, generator=g)},
        offsets=[0],
        total=rows,
    )


class Stepper:
    """The component as the runner's lane step gives it: its values, or something else (a
    result that is not values, values of other rows, values that lack an output) at step
    ``fault``; every call's arguments recorded."""

    def __init__(self, fault: int | None, kind: str) -> None:
        self.fault, self.kind = fault, kind
        self.calls: list[Any] = []
        self.n = 0

    def __call__(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        k, self.n = self.n, self.n + 1
        self.calls.append((list(args), dict(kwargs)))
        named = dict(zip(NAMES, args)) | kwargs
        x, a, w, c = (named[n] for n in NAMES)
        y = x * 0.5 + a.sum(-1, keepdim=True) * w + c
        values = {"y": y, "g": y.sum(-1)}
        if k != self.fault:
            return values
        if self.kind == "result":
            return ("a failure", k)
        if self.kind == "rows":
            return {"y": torch.cat([y, y]), "g": values["g"]}
        if self.kind == "missing":
            return {"y": y}
        return values  # "accept": ``accept`` refuses it


def reference(
    cohort: Cohort, step: Stepper, limit: int, stop: Any, accept: Any
) -> tuple[int, Any, bool]:
    """What ``burst`` does, one ``call`` and ``advance`` a step."""
    n = 0
    while n < limit:
        args, kwargs = cohort.call()
        values = step(args, kwargs)
        if type(values) is not dict or (accept is not None and not accept(values)):
            return n, values, False
        if not cohort.advance(values):
            return n, values, False
        n += 1
        if stop():
            return n, None, True
    return n, None, False


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 3),
    length=st.integers(1, 80),
    positional=st.integers(0, 4),
    before=st.integers(0, 40),
    limit=st.integers(0, 80),
    stop_after=st.one_of(st.none(), st.integers(1, 80)),
    fault=st.one_of(st.none(), st.integers(0, 80)),
    kind=st.sampled_from(["result", "rows", "missing", "accept"]),
    seed=st.integers(0, 3),
)
def test_a_burst_makes_and_commits_the_steps_that_advance_would(
    rows: int,
    length: int,
    positional: int,
    before: int,
    limit: int,
    stop_after: int | None,
    fault: int | None,
    kind: str,
    seed: int,
) -> None:
    """A cohort ``before`` steps in (so that its per-step views are cut at any offset), then a
    burst of up to ``limit`` steps (within its length) with a stop after ``stop_after`` and a
    step at ``fault`` that is not to be committed: the same arguments for every call as
    ``Cohort.call`` gives, the same count, handed-back step and stop as committing each with
    ``advance``, and the same cohort after (steps, carried, last outputs, pieces, next call)."""
    runs = []
    for way in ("burst", "reference"):
        cohort = make_cohort(rows, length, positional, seed)
        warm = Stepper(None, kind)
        for _ in range(min(before, length - 1)):
            assert cohort.advance(warm(*cohort.call()))
        step = Stepper(None if fault is None else fault + cohort.steps, kind)
        step.n = cohort.steps
        asked = 0

        def stop() -> bool:
            nonlocal asked
            asked += 1
            return stop_after is not None and asked >= stop_after

        accept = (lambda v, s=step: s.n - 1 != s.fault) if kind == "accept" else None
        budget = min(limit, length - cohort.steps)
        if way == "burst":
            got = burst(cohort, step, budget, stop, accept)
        else:
            got = reference(cohort, step, budget, stop, accept)
        runs.append((got, step.calls, cohort, asked))
    (got, calls, cohort, asked), (want, want_calls, ref, want_asked) = runs
    assert got[0] == want[0] and got[2] == want[2] and asked == want_asked
    assert same(got[1], want[1])
    assert same(calls, want_calls)
    assert cohort.steps == ref.steps
    assert same(cohort.carried, ref.carried)
    assert same(cohort.last, ref.last)
    assert same(cohort.pieces, ref.pieces)
    if not cohort.done():
        assert same(cohort.call(), ref.call())
