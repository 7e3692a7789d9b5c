"""A cohort's stream plan (``SharedSteps._band_streams``, made once per cohort): the items it
counts against each credited run per step equal ``piece_items`` of that run's own cut of the
step's joint piece (``Cohort.piece``), for stack and cat along every dim, the batch dim
included, with one run or several; and a step's reports carry each run's rows. Fabricated
cohorts (the stepper's real code, no model)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.capture import ir
from walkserve.runtime.frames import piece_items
from walkserve.runtime.loopcohort import Cohort
from walkserve.runtime.looprun import LoopStreamed, LoopStreamedRows, streamed_items
from walkserve.runtime.loopshare import Band, SharedSteps


class Steps(SharedSteps):
    def __init__(self, runs: dict[int, Any], credited: set[tuple[str, str]]) -> None:
        self._runs = runs
        self._credit = dict.fromkeys(credited, 10**9)
        self._produced = {}
        self._reports = []


@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    mode=st.sampled_from(["cat", "stack"]),
    rank=st.integers(2, 3),
    batch=st.integers(0, 1),
    acc=st.integers(-3, 2),
    steps=st.integers(1, 4),
    data=st.data(),
)
def test_counted_items_equal_each_runs_cut(
    rows: list[int], mode: str, rank: int, batch: int, acc: int, steps: int, data: Any
) -> None:
    acc = acc % rank if mode == "cat" else acc % (rank + 1)
    spec = SimpleNamespace(accumulated={"ch": 0}, outputs=["out"], out_dims={"out": batch})
    offsets = [sum(rows[:k]) for k in range(len(rows))]
    cohort = Cohort(spec, rows, 8, {}, {}, {}, offsets=offsets, total=sum(rows))  # type: ignore[arg-type]
    node = SimpleNamespace(accumulated={"ch": ir.Accumulated(0, mode, acc)})  # type: ignore[arg-type]
    runs = [
        SimpleNamespace(
            item=10 + k, i=3 * k, request=f"r{k}", start=SimpleNamespace(streams=("ch",))
        )
        for k in range(len(rows))
    ]
    credited = {(r.request, "ch") for r in runs if data.draw(st.booleans())}
    band = Band(SimpleNamespace(node=node), cohort, runs, list(enumerate(runs)))  # type: ignore[arg-type]
    stepper = Steps({r.item: r for r in runs}, credited)
    want: dict[tuple[str, str], int] = {}
    for s in range(steps):
        shape = [2 + s % 2] * rank
        shape[batch] = sum(rows)
        cohort.pieces.setdefault("ch", []).append(torch.randn(shape))
        cohort.steps += 1
        stepper._band_streamed(band)
        for k, run in enumerate(runs):
            if (run.request, "ch") in credited:
                got = piece_items(cohort.piece("ch", k), node.accumulated["ch"])
                want[(run.request, "ch")] = want.get((run.request, "ch"), 0) + got
    assert stepper._produced == want
    # the reports: each run's rows of every step, in order
    reps = [r for r in stepper._reports if isinstance(r, (LoopStreamed, LoopStreamedRows))]
    items = {}
    for item, _, index, values in streamed_items(reps):
        for j, v in enumerate(values):
            items[(item, index + j)] = v
    for s in range(steps):
        joint = cohort.pieces["ch"][s]
        for k, run in enumerate(runs):
            cut = joint if len(rows) == 1 else joint.narrow(batch, offsets[k], rows[k])
            assert torch.equal(items[(run.item, run.i + s)], cut)
