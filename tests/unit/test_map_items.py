"""A rank's conductor sends a map over a stream's chunks (a window decoder: no carried value,
no stop, one joinable node) as map items (``Conductor(maps=...)``): the windows that can start
go out as one item with a call each, completed with a list of each window's values, and
committed in window order. Pure: the conductor alone, the producer's items and the decoder's
results fabricated (each window's output is the sum of its items, so that a window cut wrong,
or committed out of order, shows in the walk's output)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fast_lane_streams import HOP, WINDOW, inputs, setup

from walkserve.capture.chunk import EndOfStream, SlidingWindow
from walkserve.capture.chunk import split as chunk_split
from walkserve.runtime.conductor import Conductor, Failed, Finished, Output, WorkItem
from walkserve.runtime.regionwalk import region_walks
from walkserve.runtime.walkspec import MAP_AHEAD


def _conductor(map_calls: int | None = None) -> tuple[Conductor, str]:
    captured, plan = setup()
    regions = region_walks(captured, plan, 0)
    (name,) = regions.regions
    conductor = Conductor(
        regions.captured,
        regions.plan,
        eager_outputs=True,
        fast_loops=True,
        maps=[(name, "decode/decoder")],
        map_calls=map_calls,
    )
    return conductor, name


def _want(items: torch.Tensor) -> torch.Tensor:
    """The audio for the stream ``items`` [1, n, 1]: one value per window, its items' sum."""
    windows = chunk_split(items, SlidingWindow(WINDOW, HOP, EndOfStream.PAD), dim=1)
    return torch.cat([w.sum(dim=1) for w, _ in windows], dim=1)  # [1, windows]


def _decode(item: WorkItem) -> list[dict[str, Any]]:
    assert item.calls is not None and item.call is None
    return [{item.ops[-1]: args[0].sum(dim=1)} for args, _ in item.calls]


@settings(max_examples=40, deadline=None)
@given(
    steps=st.integers(1, 14),
    feeds=st.lists(st.integers(1, 5), min_size=1, max_size=14),  # producer items per feed
    order=st.randoms(use_true_random=False),  # which ready map items complete first
    map_calls=st.sampled_from([None, 1, 2, 3]),  # a rank's max_batch
)
def test_map_items_cut_the_windows_and_commit_them_in_order(
    steps: int, feeds: list[int], order: Any, map_calls: int | None
) -> None:
    conductor, walk = _conductor(map_calls)
    most = map_calls or MAP_AHEAD
    conductor.submit("r", inputs(0, steps), walk, stream=False)
    (loop,) = conductor.ready()
    assert loop.kind == "loop" and loop.node == "think"
    seq = torch.arange(1.0, steps + 1).reshape(1, steps, 1)
    sizes = itertools.chain(feeds, itertools.repeat(1))
    pending: list[WorkItem] = []
    at = 0
    while at < steps:  # the producer commits its items, the windows start as they form
        n = min(next(sizes), steps - at)
        conductor.streamed_run(
            loop.id, "think.out1.all", at, [seq[:, k : k + 1] for k in range(at, at + n)]
        )
        at += n
        ready = conductor.ready()
        pending += ready
        assert all(it.calls is not None and 0 < len(it.calls) <= most for it in ready)
        order.shuffle(pending)
        while pending and order.random() < 0.5:  # some complete now, in any order
            it = pending.pop()
            conductor.complete(it.id, _decode(it))
            pending += conductor.ready()
    conductor.complete(loop.id, {"think.out1.all": seq})
    pending += conductor.ready()
    while pending:
        order.shuffle(pending)
        it = pending.pop()
        conductor.complete(it.id, _decode(it))
        pending += conductor.ready()
    events = conductor.events()
    assert not [e for e in events if isinstance(e, Failed)], events
    assert isinstance(events[-1], Finished)
    outputs = {e.name: e.value for e in events if isinstance(e, Output)}
    torch.testing.assert_close(outputs["decode.out0.all"], _want(seq))
    assert conductor.idle() and conductor.stats().live_values == 0


def _started(steps: int) -> tuple[Conductor, WorkItem, list[WorkItem]]:
    """A request whose producer committed all ``steps`` items: its loop item and the map
    items out."""
    conductor, walk = _conductor()
    conductor.submit("r", inputs(0, steps), walk, stream=False)
    (loop,) = conductor.ready()
    seq = torch.arange(1.0, steps + 1).reshape(1, steps, 1)
    conductor.streamed_run(loop.id, "think.out1.all", 0, [seq[:, k : k + 1] for k in range(steps)])
    return conductor, loop, conductor.ready()


def test_a_map_item_that_fails_fails_its_request_and_leaves_nothing() -> None:
    conductor, _, (item,) = _started(9)
    assert item.calls is not None and len(item.calls) == 3  # windows [0,4) [2,6) [4,8)
    conductor.fail(item.id, "decoder exploded")
    (failed,) = [e for e in conductor.events() if isinstance(e, Failed)]
    assert "decoder exploded" in failed.error
    assert conductor.idle() and conductor.stats().live_values == 0


def test_a_map_item_answered_with_the_wrong_number_of_windows_fails_its_request() -> None:
    conductor, _, (item,) = _started(9)
    conductor.complete(item.id, _decode(item)[:2])
    (failed,) = [e for e in conductor.events() if isinstance(e, Failed)]
    assert "a map item of 3 iterations got results for 2" in failed.error
    assert conductor.idle() and conductor.stats().live_values == 0


def test_cancel_with_map_items_out_leaves_nothing_and_ignores_their_results() -> None:
    conductor, _, (item,) = _started(9)
    assert conductor.stats().in_flight == 2  # the producer's loop item and the map item
    conductor.cancel("r")
    assert conductor.idle() and conductor.stats().live_values == 0
    assert not conductor.wanted(item.id)
    conductor.complete(item.id, _decode(item))  # late: ignored
    assert conductor.events() == [] and conductor.stats().in_flight == 0


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.sampled_from([0, 1, 2, 3, 5]), max_size=12),  # 0: a plain item
    size=st.one_of(st.none(), st.integers(1, 6)),
)
def test_steps_hold_at_most_max_batch_calls(calls: list[int], size: int | None) -> None:
    """A rank's steps are cut at ``max_batch`` calls, a map item counting each of its own: in
    order, nothing lost, no step over the limit unless one item alone holds more (which its
    conductor never makes: ``map_calls``); plain items are cut as before, ``size`` a step."""
    from walkserve.runtime.rankscheduler import _parts

    items = [
        WorkItem(k, "r", "w", "n", "component", ("c",), (), False, calls=((([], {}),) * n) or None)
        for k, n in enumerate(calls)
    ]
    parts = _parts(items, size)
    assert [it for part in parts for it in part] == items
    weight = [sum(len(it.calls or (None,)) for it in part) for part in parts]
    if size is None:
        assert len(parts) == (1 if items else 0)
        return
    assert all(w <= size or len(p) == 1 for w, p in zip(weight, parts))
    assert all(parts)
    if not any(calls):
        assert parts == [items[k : k + size] for k in range(0, len(items), size)]
