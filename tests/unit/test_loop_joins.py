"""Joined loop steps (``runtime.loopstep``): runs of a simple loop at the same body node share one
call whose arguments the stepper concatenated, and the outputs are split back per run.

Real runs in this process (``run_local``: the conductor, one rank scheduler, the runner), with
hypothesis over arrivals (runs at different iterations), horizons and batch limits: every
request gets the reference interpreter's outputs, and the calls were joined (the component saw
calls of more than one request while the runner got one item per step). A joined call that
raises is retried run by run, so the request that made it raise fails alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from walkserve import capture, testing
from walkserve.capture import Input, component, iterations, loop, walk
from walkserve.lowering.lower import lower
from walkserve.runtime import loopcohort
from walkserve.runtime.local import run_local
from walkserve.runtime.runner import NodeRunner

DIM = 8


@component
class Predictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Embedding(4, DIM)
        self.net = nn.Linear(DIM, DIM)

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        if bool((state.abs() > 100).any()):
            raise ValueError("a state is out of range")
        return state + torch.tanh(self.net(state + self.act(action)))


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRUCell(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.gru(x, h)
        return torch.tanh(self.head(h)), h


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.predictor = Predictor()
        self.cell = Cell()

    @walk(inputs={"actions": Input(dims={1: "dynamic"})})
    def rollout(self, state: torch.Tensor, actions: torch.Tensor, horizon: int) -> dict[str, Any]:
        states = []
        for k in iterations(horizon):
            state = self.step(state, actions[:, k])
            states.append(state)
        return {"states": torch.stack(states, dim=1)}

    @loop
    def step(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.predictor(state, action)  # type: ignore[no-any-return]

    @walk
    def recur(self, x: torch.Tensor, h: torch.Tensor, steps: int) -> dict[str, Any]:
        xs = []
        for _ in iterations(steps):
            x, h = self.think(x, h)
            xs.append(x)
        return {"xs": torch.cat(xs, dim=1), "h": h}

    @loop
    def think(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.cell(x, h)
        return x, h


def rollout_inputs(seed: int, horizon: int, rows: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state": torch.randn(rows, DIM, generator=g),
        "actions": torch.randint(0, 4, (rows, horizon), generator=g),
        "horizon": horizon,
    }


def recur_inputs(seed: int, steps: int) -> dict[str, Any]:
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
        model = Model().eval().requires_grad_(False)
        sample = {**rollout_inputs(0, 3), **recur_inputs(0, 3)}
        captured = capture.trace(model, sample)
        CACHE["m"] = (captured, lower(captured, sample, check_capture=False))
    return CACHE["m"]  # type: ignore[no-any-return]


def test_both_loops_are_joinable() -> None:
    captured, plan = setup()
    assert NodeRunner(captured, plan).joinable() >= {
        ("rollout", "step/predictor"),
        ("recur", "think/cell"),
    }


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 7), min_size=2, max_size=6),
    arrive=st.lists(st.integers(0, 5), min_size=6, max_size=6),
    rows=st.lists(st.integers(1, 2), min_size=6, max_size=6),
    max_batch=st.one_of(st.none(), st.integers(2, 3)),
    which=st.sampled_from(["rollout", "recur"]),
)
def test_joined_steps_give_the_interpreters_outputs(
    lengths: list[int], arrive: list[int], rows: list[int], max_batch: int | None, which: str
) -> None:
    captured, plan = setup()
    if which == "rollout":
        reqs = {f"r{i}": rollout_inputs(i, n, rows[i]) for i, n in enumerate(lengths)}
    else:
        reqs = {f"r{i}": recur_inputs(i, n) for i, n in enumerate(lengths)}
    arrivals = {f"r{i}": arrive[i] for i in range(len(lengths))}
    result = run_local(captured, plan, reqs, walks=which, arrivals=arrivals, max_batch=max_batch)
    assert result.failed == {}
    for rid, r in reqs.items():
        testing.assert_outputs_match(result.outputs[rid], captured.run(r, which))
    node = "step/predictor" if which == "rollout" else "think/cell"
    for d in result.dispatches:
        if d.node == node and d.region:
            # one call per joined item, as many requests in it as members in the step
            assert sum(d.calls) == len(d.members)
            assert max(d.calls) <= (max_batch or len(reqs))
    together = [d for d in result.dispatches if d.node == node and len(d.members) > 1]
    if max(arrivals.values()) == min(arrivals.values()) and (max_batch or 2) > 1:
        assert together, "runs that started together shared no call"
    assert result.rank_values == 0
    assert result.loop_counters["loop_stepper/cohort_steps"] > 0


def test_a_joined_call_that_raises_fails_only_the_request_that_made_it() -> None:
    captured, plan = setup()
    reqs = {f"r{i}": rollout_inputs(i, 4) for i in range(4)}
    reqs["r2"]["state"][0, 3] = 500.0
    result = run_local(captured, plan, reqs, walks="rollout")
    assert set(result.failed) == {"r2"} and "out of range" in result.failed["r2"]
    for rid in ("r0", "r1", "r3"):
        testing.assert_outputs_match(result.outputs[rid], captured.run(reqs[rid], "rollout"))
    calls = [c for d in result.dispatches if d.node == "step/predictor" for c in d.calls]
    assert calls[0] == 4  # the first step was one joined call of all four
    assert max(calls[1:]) == 3  # then the three good runs joined again, after a step alone
    assert result.rank_values == 0


# A region's outputs (its loop's channels) by the walk output the interpreter gives for them.
REGION_OUTPUTS = {
    "rollout": {"step.state.all": "states"},
    "recur": {"think.x.all": "xs", "think.h": "h"},
}


@contextlib.contextmanager
def _views_cut_every(steps: int) -> Iterator[None]:
    saved, loopcohort.VIEWS = loopcohort.VIEWS, steps
    try:
        yield
    finally:
        loopcohort.VIEWS = saved


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    arrive=st.lists(st.integers(0, 4), min_size=5, max_size=5),
    cancel=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=5, max_size=5),
    which=st.sampled_from(["rollout", "recur"]),
    stream=st.booleans(),
    lane=st.integers(0, 3),
    views=st.sampled_from([1, 2, 3, loopcohort.VIEWS]),
)
def test_cohorts_with_arrivals_and_cancels_give_the_interpreters_outputs(
    lengths: list[int],
    arrive: list[int],
    cancel: list[int | None],
    which: str,
    stream: bool,
    lane: int,
    views: int,
) -> None:
    """The rank scheduler and the real runner, step by step: runs arrive at different steps
    (a cohort dissolves and forms again with them) and some are cancelled mid-cohort; every
    other run gets the interpreter's outputs (streamed pieces too, in order), the steps ran as
    cohorts, and nothing is held at the end. ``lane``: after each round, up to that many steps
    of the engine's fast lane (``lane()``), as the engine takes them while no command waits.
    ``views``: a cohort's per-step slices cut that many steps at a time (``Cohort.call``), so
    that loops of these lengths cross the cut as the longer loops of a server do."""
    with _views_cut_every(views):
        from walkserve.runtime.rankreports import RegionDone, RegionFailed, RegionStreamed
        from walkserve.runtime.rankscheduler import RankScheduler
        from walkserve.runtime.regionwalk import region_walks

        captured, plan = setup()
        runner = NodeRunner(captured, plan, 0)
        sched = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
        region = plan.regions[which][0].name
        make = rollout_inputs if which == "rollout" else recur_inputs
        reqs = {k: make(k, n) for k, n in enumerate(lengths)}
        outputs: dict[int, dict[str, Any]] = {}
        pieces: dict[int, list[tuple[int, Any]]] = {k: [] for k in reqs}
        step = lanes = 0
        while len(outputs) < len(reqs) and step < 100:
            for k in reqs:
                if arrive[k] == step:
                    sched.start(k, f"q{k}", which, region, reqs[k], stream)
                if cancel[k] is not None and arrive[k] + cancel[k] == step and k not in outputs:
                    sched.cancel(f"q{k}")
                    outputs[k] = {}
            steps = sched.schedule()
            for s in steps:
                sched.update(s, runner.run(s.walk, s.node, s.items))
            lanes += testing.lane_steps(sched, runner, lane if steps else 0)
            for rep in sched.reports():
                assert not isinstance(rep, RegionFailed), rep
                if isinstance(rep, RegionDone) and rep.item not in outputs:
                    outputs[rep.item] = rep.outputs
                if isinstance(rep, RegionStreamed):
                    pieces[rep.item].append((rep.index, rep.value))
            step += 1
        names = REGION_OUTPUTS[which]
        for k, r in reqs.items():
            if not outputs[k]:
                continue
            want = captured.run(r, which)
            got = {names[ch]: v for ch, v in outputs[k].items() if ch in names}
            testing.assert_outputs_match(got, want)
            if stream:
                assert [i for i, _ in pieces[k]] == list(range(lengths[k]))
                joined = [v for _, v in pieces[k]]
                full = torch.stack(joined, 1) if which == "rollout" else torch.cat(joined, 1)
                torch.testing.assert_close(full, want["states" if which == "rollout" else "xs"])
        if any(outputs.values()):
            assert sched.loops.counters()["loop_stepper/cohort_steps"] > 0
        assert sched.stats().live_values == 0 and sched.idle()


def test_the_fast_lane_steps_a_lone_cohort_until_the_rank_is_told_something() -> None:
    """``lane()`` steps a lone cohort only while nothing reached the rank: a new
    run (a command) stops it until ``schedule`` has seen it; a loop that the last
    ``schedule`` started takes the lane right after its first step (its start left the
    rank settled); the outputs are the interpreter's either way."""
    from walkserve.runtime.rankreports import RegionDone
    from walkserve.runtime.rankscheduler import RankScheduler
    from walkserve.runtime.regionwalk import region_walks

    captured, plan = setup()
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    region = plan.regions["rollout"][0].name
    reqs = {0: rollout_inputs(0, 12), 1: rollout_inputs(1, 6)}
    sched.start(0, "q0", "rollout", region, reqs[0], False)
    assert sched.lane() is None  # the start: schedule() first

    def round_() -> int:
        for s in sched.schedule():
            sched.update(s, runner.run(s.walk, s.node, s.items))
        if 1 in started:
            return testing.lane_steps(sched, runner, 100)
        n = testing.lane_steps(sched, runner, 3)
        if n == 3:
            started.add(1)
            sched.start(1, "q1", "rollout", region, reqs[1], False)
            assert sched.lane() is None  # a newcomer joins at the next schedule()
        return n

    started: set[int] = set()
    lane = [round_() for _ in range(6)]
    assert lane[0] == 3  # no second pass before the lane: the first round's start settled
    assert sched.loops.counters()["loop_stepper/lane_steps"] == sum(lane)
    done = {r.item: r.outputs for r in sched.reports() if isinstance(r, RegionDone)}
    for k, r in reqs.items():
        want = captured.run(r, "rollout")
        testing.assert_outputs_match({"states": done[k]["step.state.all"]}, want)
    assert sched.idle() and sched.stats().live_values == 0


def test_a_lane_step_that_raises_fails_only_the_request_that_made_it() -> None:
    """A cohort in the engine's fast lane whose call raises (one request's action at step 5 is
    past the embedding): its runs go on one by one, that request fails alone, the others get
    the interpreter's outputs, and nothing is held."""
    from walkserve.runtime.rankscheduler import RankScheduler
    from walkserve.runtime.regionwalk import region_walks

    captured, plan = setup()
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    region = plan.regions["rollout"][0].name
    reqs = {k: rollout_inputs(k, 9) for k in range(3)}
    reqs[1]["actions"][0, 5] = 7
    with pytest.raises(Exception, match="index"):
        captured.run(reqs[1], "rollout")
    for k, r in reqs.items():
        sched.start(k, f"q{k}", "rollout", region, r, False)
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    lane = 0
    for _ in range(40):
        for s in sched.schedule():
            sched.update(s, runner.run(s.walk, s.node, s.items))
        lane += testing.lane_steps(sched, runner, 100)
        take_exits(sched, done, failed)
        if len(done) + len(failed) == len(reqs):
            break
    assert set(failed) == {1} and "index" in failed[1]
    for k in (0, 2):
        want = captured.run(reqs[k], "rollout")
        testing.assert_outputs_match({"states": done[k]["step.state.all"]}, want)
    assert lane > 0 and sched.loops.counters()["loop_stepper/lane_steps"] == lane
    assert sched.idle() and sched.stats().live_values == 0


@pytest.mark.parametrize("bad_at", [None, 0, 3])
def test_runs_that_arrive_one_by_one_join_the_running_cohort(bad_at: int | None) -> None:
    """Requests arriving one per round join the cohort that runs (``extend``: no re-forming
    it), and at its length the runs with iterations left go on as one (``shrink``); every
    request gets the interpreter's outputs. ``bad_at``: the iteration at which the last
    arrival's action is past the embedding, so that the joint call raises (at 0: in the very
    step after it joined, before the runs already there took a step in the new cohort; their
    state is then the joint one): it fails alone and the others go on."""
    from walkserve.runtime import loopshare
    from walkserve.runtime.rankscheduler import RankScheduler
    from walkserve.runtime.regionwalk import region_walks

    captured, plan = setup()
    runner = NodeRunner(captured, plan, 0)
    sched = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    region = plan.regions["rollout"][0].name
    reqs = {k: rollout_inputs(k, n) for k, n in enumerate([7, 9, 4, 8])}
    last = len(reqs) - 1
    if bad_at is not None:
        reqs[last]["actions"][0, bad_at] = 7
    calls = {"extend": 0, "shrink": 0}

    def counted(name: str) -> Any:
        real = getattr(loopshare, name)

        def call(*args: Any) -> Any:
            out = real(*args)
            calls[name] += out is not None
            return out

        return call

    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in calls:
            mp.setattr(loopshare, name, counted(name))
        for step in range(60):
            if step in reqs:
                sched.start(step, f"q{step}", "rollout", region, reqs[step], False)
            for s in sched.schedule():
                sched.update(s, runner.run(s.walk, s.node, s.items))
            take_exits(sched, done, failed)
            if len(done) + len(failed) == len(reqs):
                break
    assert calls["extend"] >= 1 and calls["shrink"] >= 1
    assert set(failed) == ({last} if bad_at is not None else set())
    for k, r in reqs.items():
        if k not in failed:
            want = captured.run(r, "rollout")
            testing.assert_outputs_match({"states": done[k]["step.state.all"]}, want)
    assert sched.idle() and sched.stats().live_values == 0


def test_a_tuple_item_read_gives_the_interpreters_value_and_error() -> None:
    """The runner reads glue ``value[k]`` directly (``_item_read``): the same objects the
    interpreter's op gives, and when the read fails, the interpreter's own error."""
    from walkserve.capture.interpret import Interpreter
    from walkserve.runtime.runner import RunItem

    captured, plan = setup()
    runner = NodeRunner(captured, plan)
    entry = runner._nodes[("recur", "think/cell")]
    comp, first, second = entry.all_ops
    assert set(entry.items) == {first, second}  # both getitems read directly
    x, h = torch.randn(1, DIM), torch.randn(1, DIM)
    item = RunItem(0, entry.all_ops, {}, (first, second))
    got = runner._finish(entry, item, {comp: (x, h)})
    assert got.values is not None and got.values[first] is x and got.values[second] is h
    bad = runner._finish(entry, item, {comp: (x,)})  # one value where the op reads two
    with pytest.raises(Exception) as want:
        Interpreter(captured).op(entry.ops[second], {comp: (x,)})
    assert bad.error == str(want.value) and second in str(bad.error)


def take_exits(sched: Any, done: dict[int, Any], failed: dict[int, str]) -> None:
    """The region runs whose exit ``sched`` reported since: outputs in ``done``, errors in
    ``failed``, by item."""
    from walkserve.runtime.rankreports import RegionDone, RegionFailed

    for rep in sched.reports():
        if isinstance(rep, RegionDone):
            done[rep.item] = rep.outputs
        if isinstance(rep, RegionFailed):
            failed[rep.item] = rep.error
