"""A cohort's streamed rows (``LoopStreamedRows``) cut many steps at once: the same items, in
each run's channel's order, as cutting every step's rows one by one."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.looprun import LoopStreamed, LoopStreamedRows, streamed_items


def flattened(items: Any) -> dict[tuple[int, str], list[tuple[int, torch.Tensor]]]:
    """Each (item, channel)'s (index, value) in order."""
    out: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
    for item, channel, index, values in items:
        for k, v in enumerate(values):
            out.setdefault((item, channel), []).append((index + k, v))
    return out


@st.composite
def cohort_reports(draw: Any) -> list[LoopStreamed | LoopStreamedRows]:
    """Steps of cohorts of runs (rows of one joint piece), streaming one or two channels,
    the cohort changing runs or the piece its shape now and then, lone runs' items between."""
    reports: list[LoopStreamed | LoopStreamedRows] = []
    dim = draw(st.integers(0, 1))
    width = 3
    next_item = 0
    for _ in range(draw(st.integers(1, 4))):  # cohorts
        rows = draw(st.lists(st.integers(1, 3), min_size=2, max_size=4))
        offsets = [sum(rows[:k]) for k in range(len(rows))]
        firsts = draw(st.lists(st.integers(0, 5), min_size=len(rows), max_size=len(rows)))
        items = list(range(next_item, next_item + len(rows)))
        next_item += len(rows)
        layout = tuple(zip(items, firsts, offsets, rows))
        channels = draw(st.sampled_from([["a"], ["a", "b"]]))
        for step in range(draw(st.integers(1, 6))):
            if draw(st.integers(0, 5)) == 0:
                width += 1  # a piece of another shape: no longer one block
            for ch in channels:
                shape = [sum(rows), width] if dim == 0 else [width, sum(rows)]
                piece = torch.randn(shape)
                reports.append(LoopStreamedRows(ch, dim, layout, step, piece))
            if draw(st.integers(0, 4)) == 0:  # a lone run's item between
                reports.append(LoopStreamed(1000 + step, "a", step, torch.randn(1, width)))
    return reports


@settings(max_examples=80, deadline=None)
@given(reports=cohort_reports())
def test_streamed_items_equal_cutting_each_step(reports: list[Any]) -> None:
    one_by_one = []
    for rep in reports:
        for one in rep.split() if isinstance(rep, LoopStreamedRows) else [rep]:
            one_by_one.append((one.item, one.channel, one.index, (one.value,)))
    want = flattened(one_by_one)
    got = flattened(streamed_items(reports))
    assert set(got) == set(want)
    for key, items in want.items():
        assert [i for i, _ in got[key]] == [i for i, _ in items]
        for (_, g), (_, w) in zip(got[key], items):
            assert g.shape == w.shape and torch.equal(g, w)


def test_a_cohorts_steps_are_cut_with_one_stack() -> None:
    layout = ((7, 0, 0, 1), (8, 3, 1, 2))
    reports = [LoopStreamedRows("a", 0, layout, k, torch.full((3, 2), float(k))) for k in range(5)]
    got = list(streamed_items(reports))
    assert [(item, ch, index, len(v)) for item, ch, index, v in got] == [
        (7, "a", 0, 5),
        (8, "a", 3, 5),
    ]
    # a step of another runs object is a block of its own
    other = LoopStreamedRows("a", 0, tuple(list(layout)), 5, torch.zeros(3, 2))
    assert len(list(streamed_items([*reports, other]))) == 4
