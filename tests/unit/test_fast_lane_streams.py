"""The engine's fast lane (``RankScheduler.lane``) for a loop that feeds a stream of its own
region: a recurrent producer's items go into a sliding-window buffer whose consumer loop runs
when a window forms. Items that form no window leave the rank settled, so the lane steps the
producer on; a window (or a client's stream item) stops the lane for a scheduling pass.

Real runs in this process (the rank scheduler and the runner, as the engine drives them), with
hypothesis over lengths, arrivals and lane depths: every request gets the reference
interpreter's outputs, streamed items arrive in order, nothing is held at the end, and the lane
ran steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from walkserve import capture, testing
from walkserve.capture import component, iterations, loop, stream, walk
from walkserve.capture.chunk import EndOfStream, SlidingWindow
from walkserve.lowering.lower import lower
from walkserve.runtime.rankreports import RegionDone, RegionFailed, RegionOutput, RegionStreamed
from walkserve.runtime.rankscheduler import RankScheduler
from walkserve.runtime.regionwalk import region_walks
from walkserve.runtime.runner import NodeRunner

DIM, WINDOW, HOP = 8, 4, 2


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.net(torch.cat([x, h], -1)))
        return h[:, None, :1], h  # an item [B, 1, 1] of the stream, the next state


@component
class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(WINDOW, 3)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        return self.net(window[..., 0])  # [B, WINDOW, 1] -> [B, 3]


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = Cell()
        self.decoder = Decoder()

    @walk
    def speak(self, x: torch.Tensor, h: torch.Tensor, steps: int) -> dict[str, Any]:
        items = []
        for _ in iterations(steps):
            h, item = self.think(h, x)
            items.append(item)
        seq = torch.cat(items, dim=1)  # [B, steps, 1]
        windows = stream(seq, SlidingWindow(WINDOW, HOP, EndOfStream.PAD), dim=1)
        return {"seq": seq, "audio": torch.cat([self.decode(w) for w in windows], dim=1)}

    @loop
    def think(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        item, h = self.cell(x, h)
        return h, item  # the carried value first

    @loop
    def decode(self, window: torch.Tensor) -> torch.Tensor:
        return self.decoder(window)  # type: ignore[no-any-return]


def inputs(seed: int, steps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(1, DIM, generator=g),
        "h": torch.randn(1, DIM, generator=g),
        "steps": steps,
    }


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest


CACHE: dict[str, Any] = {}


def setup() -> tuple[capture.CapturedModel, Any]:
    if not CACHE:
        torch.manual_seed(0)
        model = Speech().eval().requires_grad_(False)
        sample = inputs(0, 6)
        captured = capture.trace(model, sample)
        CACHE["m"] = (captured, lower(captured, sample, check_capture=False))
    return CACHE["m"]  # type: ignore[no-any-return]


@settings(max_examples=20, deadline=None)
@example(lengths=[12, 10], arrive=[0, 0, 0, 0], lane=3, client=False, limit=64)  # lanes
@given(
    lengths=st.lists(st.integers(1, 13), min_size=1, max_size=4),
    arrive=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    lane=st.integers(1, 8),
    client=st.booleans(),
    limit=st.sampled_from([WINDOW, WINDOW + 1, 64]),
)
def test_a_producer_feeding_a_window_consumer_takes_the_lane_and_gives_the_interpreters_outputs(
    lengths: list[int], arrive: list[int], lane: int, client: bool, limit: int
) -> None:
    """``limit``: the stream buffer's, so small that the producer waits for the consumer's
    credit (a cohort holding a run its credit stops is dissolved; the lane does not step it)."""
    captured, plan = setup()
    (region,) = [r.name for r in plan.regions["speak"]]
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(
        region_walks(captured, plan, 0), joins=runner.joinable(), stream_buffer_limit=limit
    )
    reqs = {k: inputs(k, n) for k, n in enumerate(lengths)}
    outputs: dict[int, dict[str, Any]] = {}
    pieces: dict[tuple[int, str], list[int]] = {}
    early: dict[int, dict[str, Any]] = {}
    step = 0
    while len(outputs) < len(reqs) and step < 200:
        started = {k: r for k, r in reqs.items() if arrive[k] == step}
        _, reports = one_pass(sched, runner, region, started, client, lane)
        for rep in reports:
            assert not isinstance(rep, RegionFailed), rep
            if isinstance(rep, RegionOutput):  # known before the exit: the producer's
                early.setdefault(rep.item, {}).update(rep.outputs)
            if isinstance(rep, RegionDone):
                outputs[rep.item] = early.pop(rep.item, {}) | rep.outputs
            if isinstance(rep, RegionStreamed):
                pieces.setdefault((rep.item, rep.channel), []).append(rep.index)
        step += 1
    assert set(outputs) == set(reqs)
    for k, r in reqs.items():
        want = captured.run(r, "speak")
        got = sched_outputs(outputs[k], want)
        testing.assert_outputs_match(got, want)
        if client:  # each client stream's items in order, each once
            for (item, _), got_items in pieces.items():
                if item == k:
                    assert got_items == list(range(len(got_items)))
    assert sched.stats().live_values == 0 and sched.idle()
    if not client and min(lengths) > 2 * WINDOW and len(set(arrive[: len(lengths)])) == 1:
        # items only a window consumer reads: the lane stepped between windows (a client's
        # stream item stops it at every step, so that the engine reports it at once); with a
        # run shorter than that, a window, an exit or a padded last window may follow every
        # step (lengths [2, 4]: none is settled after any step)
        assert sched.loops.counters()["loop_stepper/lane_steps"] > 0


def one_pass(
    sched: RankScheduler,
    runner: NodeRunner,
    region: str,
    started: dict[int, dict[str, Any]],
    client: bool,
    lane: int,
) -> tuple[int, list[Any]]:
    """One engine pass: the requests ``started`` now, a schedule and its steps, then up to
    ``lane`` fast-lane steps (while no command waits; none after an empty pass): the lane's
    steps taken, and the pass's reports."""
    for k, r in started.items():
        sched.start(k, f"q{k}", "speak", region, r, client)
    steps = sched.schedule()
    for s in steps:
        sched.update(s, runner.run(s.walk, s.node, s.items))
    taken = testing.lane_steps(sched, runner, lane if steps else 0)
    return taken, sched.reports()


def sched_outputs(region_out: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """The region's outputs (its loops' channels) by the walk outputs they are."""
    by_loop = {"seq": "think.", "audio": "decode."}
    got = {}
    for name, prefix in by_loop.items():
        (value,) = [
            v for ch, v in region_out.items() if ch.startswith(prefix) and ch.endswith(".all")
        ]
        got[name] = value
    assert set(got) == set(want)
    return got


@pytest.mark.parametrize("client, limit", [(False, 64), (False, WINDOW + 1), (True, 64)])
def test_the_windows_of_a_request_that_streams_nothing_out_wait_for_the_producer(
    client: bool, limit: int
) -> None:
    """A request whose client reads only the final outputs: the windows its producer forms
    are not urgent (nothing of the consumer leaves the rank before the exit), so the lane steps
    the producer back to back to its end and the consumer's steps follow, instead of the rank
    switching models at every window. Its items wait in the lane and reach the inner conductor
    in one call when it ends, or when the stream's credit stops the producer (``limit``: the
    buffer; the consumer's iterations start on them, which frees the buffer, and the lane goes
    on). A client's stream does not stop the lane: each step's item is given to the inner
    conductor at once, for the client, and the lane steps on until the first window forms,
    whose consumer's step is urgent then (something of it leaves the rank). Outputs are the
    interpreter's either way."""
    captured, plan = setup()
    (region,) = [r.name for r in plan.regions["speak"]]
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(
        region_walks(captured, plan, 0), joins=runner.joinable(), stream_buffer_limit=limit
    )
    given: list[int] = []  # items per call of the inner conductor's streamed_run
    streamed_run = sched.conductor.streamed_run

    def spy(item: int, channel: str, index: int, values: Any) -> bool:
        given.append(len(values))
        return streamed_run(item, channel, index, values)

    sched.conductor.streamed_run = spy  # type: ignore[method-assign]
    steps = 13  # 6 windows form while it runs
    r = inputs(3, steps)
    sched.start(0, "q0", "speak", region, r, client)
    for s in sched.schedule():  # its first step
        sched.update(s, runner.run(s.walk, s.node, s.items))
    lane = testing.lane_steps(sched, runner, 100)
    if client:  # item by item to the first window: the first step's, then the lane's
        assert lane == WINDOW - 1 and given == [1] * WINDOW
    else:  # its first step's, then the lane's all at once, or a buffer's worth at a time
        assert (
            lane == steps - 1
            and given[0] == 1
            and sum(given) == steps
            and max(given) >= min(limit, steps) - 2
        )
    done = run_to_exit(sched, runner)
    want = captured.run(r, "speak")
    testing.assert_outputs_match(sched_outputs(done, want), want)
    assert sched.stats().live_values == 0 and sched.idle()


def test_a_request_cancelled_while_the_lane_holds_its_items_leaves_nothing_behind() -> None:
    """Items the lane held for a request that streams nothing out (``RegionItems.deferrable``)
    die with it when it is cancelled mid-lane: the next pass gives them to no one, nothing is
    held after it, and a request started after it gets the interpreter's outputs."""
    captured, plan = setup()
    (region,) = [r.name for r in plan.regions["speak"]]
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    sched.start(0, "q0", "speak", region, inputs(3, 13), False)
    for s in sched.schedule():
        sched.update(s, runner.run(s.walk, s.node, s.items))
    assert testing.lane_steps(sched, runner, 5) == 5
    assert sched.loops.reporting()  # its 5 lane steps' items, held
    sched.cancel("q0")
    assert sched.schedule() == []
    assert not sched.loops.reporting() and not sched.reports()
    assert sched.stats().live_values == 0 and sched.idle()
    r = inputs(4, 13)
    sched.start(1, "q1", "speak", region, r, False)
    done = run_to_exit(sched, runner)
    want = captured.run(r, "speak")
    testing.assert_outputs_match(sched_outputs(done, want), want)
    assert sched.stats().live_values == 0 and sched.idle()


def test_a_map_over_chunks_runs_the_ready_chunks_as_one_call() -> None:
    """The window decoder carries nothing and has no stop: its iterations depend on nothing of
    each other, so up to ``MAP_AHEAD`` of them are in flight and the windows that are ready
    run as one batched call (a producer with a carried state keeps two), sent as one map item
    (``WorkItem.calls``). Outputs are the interpreter's."""
    from walkserve.runtime.walkspec import MAP_AHEAD

    captured, plan = setup()
    (region,) = [r.name for r in plan.regions["speak"]]
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    specs = {
        ls.node.name: ls.ahead for spec in sched.conductor._walks.values() for ls in spec.loops
    }
    assert specs == {"think": 2, "decode": MAP_AHEAD}
    r = inputs(5, 13)  # 6 windows, all formed before the consumer runs (nothing streams out)
    sched.start(0, "q0", "speak", region, r, False)
    sizes: dict[str, list[int]] = {}
    done = run_to_exit(sched, runner, sizes)
    decoder = [n for node, ns in sizes.items() if node.startswith("decode") for n in ns]
    assert max(decoder) > 2, sizes
    assert sched.conductor.stats().in_flight == 0
    want = captured.run(r, "speak")
    testing.assert_outputs_match(sched_outputs(done, want), want)
    assert sched.stats().live_values == 0 and sched.idle()


def run_to_exit(
    sched: RankScheduler, runner: NodeRunner, sizes: dict[str, list[int]] | None = None
) -> dict[str, Any]:
    """Schedule passes, each followed by the fast lane as far as it goes, until the one region
    run started on ``sched`` exits; its outputs (those reported early too). ``sizes``: each
    node's scheduled steps, by how many calls each held (an item's, a map item's each)."""
    early: dict[str, Any] = {}
    for _ in range(100):
        for s in sched.schedule():
            if sizes is not None:  # a map item holds a call per iteration
                calls = sum(len(getattr(it, "calls", None) or [None]) for it in s.items)
                sizes.setdefault(s.node, []).append(calls)
            sched.update(s, runner.run(s.walk, s.node, s.items))
        testing.lane_steps(sched, runner, 100)
        for rep in sched.reports():
            assert not isinstance(rep, RegionFailed), rep
            if isinstance(rep, RegionOutput):
                early.update(rep.outputs)
            if isinstance(rep, RegionDone):
                return early | rep.outputs
    raise AssertionError("the region run did not exit in 100 passes")


@settings(max_examples=25, deadline=None)
@example(lengths=[14, 12], arrive=[0, 0, 0], lanes=[9], client=False, limit=64)
@example(lengths=[14], arrive=[0, 0, 0], lanes=[9, 3], client=False, limit=WINDOW + 1)
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=3),
    arrive=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    lanes=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    client=st.booleans(),
    limit=st.sampled_from([WINDOW, WINDOW + 1, WINDOW + 3, 64]),
)
def test_quick_lane_commits_change_nothing_a_step_by_step_commit_would_not(
    lengths: list[int], arrive: list[int], lanes: list[int], client: bool, limit: int
) -> None:
    """The lane's quick commits (``LoopStepper.lane_budget``, ``lane_burst``: steps after
    which nothing but the cohort changes, reported when the lane ends) against a scheduler
    that commits every step in full: driven alike (arrivals, passes, lanes of random depths),
    both take the same lane steps in every lane, make the same reports in the same order with
    equal values, count the same steps and batch sizes, and stop at the same credit."""
    captured, plan = setup()
    (region,) = [r.name for r in plan.regions["speak"]]
    runner = NodeRunner(captured, plan, 0)

    def make() -> RankScheduler:
        return RankScheduler(
            region_walks(captured, plan, 0), joins=runner.joinable(), stream_buffer_limit=limit
        )

    quick, full = make(), make()
    full.loops.lane_budget = lambda band, held: 0  # type: ignore[method-assign]
    commits = []  # how many steps each of the quick scheduler's bursts committed
    lane_burst = quick.loops.lane_burst

    def spy(band: Any, step: Any, limit: int, stop: Any) -> Any:
        made, left, stopped = lane_burst(band, step, limit, stop)
        commits.append(made)
        return made, left, stopped

    quick.loops.lane_burst = spy  # type: ignore[method-assign]
    reqs = {k: inputs(10 + k, n) for k, n in enumerate(lengths)}
    quick_steps = 0
    done = 0
    for step in range(300):
        reports = []
        started = {k: r for k, r in reqs.items() if arrive[k] == step}
        for sched in (quick, full):
            reports.append(
                one_pass(sched, runner, region, started, client, lanes[step % len(lanes)])
            )
        (taken, got), (taken_full, want) = reports
        assert taken == taken_full
        assert [describe(r) for r in got] == [describe(r) for r in want]
        for g, w in zip(got, want):
            assert_equal_values(g, w)
        done += sum(isinstance(r, RegionDone) for r in got)
        quick_steps += taken
        if done == len(reqs):
            break
    assert done == len(reqs)
    if not client and max(lanes) >= 4 and min(lengths) >= 8 and len(set(arrive)) == 1:
        assert any(commits)  # a lone cohort's items only windows read: quick commits ran
    assert quick.loops.counters() == full.loops.counters()
    assert quick.batch_sizes == full.batch_sizes
    assert quick.loops._produced == full.loops._produced
    for sched in (quick, full):
        assert sched.stats().live_values == 0 and sched.idle()


def describe(rep: Any) -> tuple[Any, ...]:
    return (
        type(rep).__name__,
        rep.item,
        getattr(rep, "channel", None),
        getattr(rep, "index", None),
        sorted(getattr(rep, "outputs", {}) or {}),
    )


def assert_equal_values(got: Any, want: Any) -> None:
    for name in ("value", "outputs"):
        g, w = getattr(got, name, None), getattr(want, name, None)
        if isinstance(g, dict):
            assert g.keys() == w.keys()
            for k in g:
                assert torch.equal(g[k], w[k]), k
        elif isinstance(g, torch.Tensor):
            assert torch.equal(g, w)
