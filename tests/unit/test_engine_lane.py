"""The engine loop (``EngineLoop``, in this process, no sockets) hands a loop that starts alone
to the fast lane from its first step (``RankScheduler.lane_of``): every step of a lone request
is a lane step, each counted once (the stepper's steps, the rank's batch sizes), and its
outputs are the reference interpreter's. A command that waits when the lane would take over
the pass's step does not lose that step. A burst whose starts come in chunks with ``more``
(``burst``) is held until its last chunk, then steps as one cohort; one whose last chunk never
comes is stepped at the hold's deadline."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from walkserve import capture, testing
from walkserve.capture import Input, component, iterations, loop, walk
from walkserve.lowering.lower import lower
from walkserve.runtime import messages as m
from walkserve.runtime.engine import EngineLoop
from walkserve.runtime.rankcommands import StartRun, StatsAsk
from walkserve.runtime.rankscheduler import RankScheduler
from walkserve.runtime.regionwalk import region_walks
from walkserve.runtime.runner import NodeRunner
from walkserve.runtime.transport import LocalTransport, ObjectStore

DIM = 8


@component
class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(DIM, DIM)
        self.act = nn.Embedding(4, DIM)

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return state + torch.tanh(self.net(state + self.act(action)))


class Rollout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.step = Step()

    @walk(inputs={"actions": Input(dims={1: "dynamic"})})
    def rollout(self, state: torch.Tensor, actions: torch.Tensor, horizon: int) -> dict[str, Any]:
        states = []
        for k in iterations(horizon):
            state = self.advance(state, actions[:, k])
            states.append(state)
        return {"states": torch.stack(states, dim=1)}

    @loop
    def advance(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.step(state, action)  # type: ignore[no-any-return]


def _inputs(seed: int, horizon: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state": torch.randn(1, DIM, generator=g),
        "actions": torch.randint(0, 4, (1, horizon), generator=g),
        "horizon": horizon,
    }


class _Script:
    """The engine's inbox: each request's start once the one before is done, a stats ask with
    each start when ``ask``; stops the loop after the last."""

    def __init__(self, requests: list[dict[str, Any]], region: str, ask: bool) -> None:
        self.engine: EngineLoop | None = None
        self.requests, self.region, self.ask = requests, region, ask
        self.started = self.done = 0
        self.stopping = threading.Event()

    def read(self, wait: bool, within_s: float | None = None) -> None:
        assert self.engine is not None
        if self.done < self.started:
            return
        if self.started == len(self.requests):
            self.stopping.set()
            return
        k = self.started
        self.started += 1
        start = StartRun(k, f"q{k}", "rollout", self.region, self.requests[k], False)
        self.engine.put_all([start, StatsAsk(k)] if self.ask else [start])

    def waiting(self) -> bool:
        return False


@functools.cache
def _model() -> tuple[Any, Any, str]:
    torch.manual_seed(0)
    model = Rollout().eval().requires_grad_(False)
    sample = _inputs(0, 3)
    captured = capture.trace(model, sample)
    plan = lower(captured, sample)
    (region,) = [r.name for r in plan.regions["rollout"]]
    return captured, plan, region


@settings(max_examples=12, deadline=None)
@given(horizons=st.lists(st.integers(1, 12), min_size=1, max_size=4), ask=st.booleans())
def test_a_lone_loop_takes_the_lane_from_its_first_step(horizons: list[int], ask: bool) -> None:
    captured, plan, region = _model()
    runner = NodeRunner(captured, plan, 0)
    scheduler = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    requests = [_inputs(seed, h) for seed, h in enumerate(horizons)]
    script = _Script(requests, region, ask)
    done: dict[int, dict[str, Any]] = {}
    objects = ObjectStore(0)
    transport = LocalTransport()

    def send(msg: m.Message) -> None:
        if isinstance(msg, m.RegionEvents):
            for e in msg.events:
                assert isinstance(e, (m.RegionDone, m.RegionOutput)), e
                if isinstance(e, m.RegionDone):
                    done[e.item] = {k: transport.receive(v, "")[0] for k, v in e.outputs.items()}
                    script.done += 1

    engine = script.engine = EngineLoop(0, plan, runner, scheduler, transport, objects, send)
    engine.run(script.stopping, inbox=script)
    for k, r in enumerate(requests):
        (got,) = done[k].values()  # the region's one output: the stacked states
        testing.assert_outputs_match({"states": got}, captured.run(r, "rollout"))
    counters = scheduler.loops.counters()
    assert counters["loop_stepper/lane_steps"] == sum(horizons)  # the first steps too
    assert scheduler.loops.steps == sum(horizons)  # each step counted once
    assert scheduler.stats().batch_sizes == {1: sum(horizons)}
    assert scheduler.idle() and scheduler.stats().live_values == 0


class _Burst:
    """The engine's inbox: one burst of requests in chunks of ``chunk``, each but the last
    with ``more`` (``last``: whether the last is sent at all; else the hold's deadline must
    start them), one chunk per read; stops the loop when every request is done."""

    def __init__(self, requests: list[dict[str, Any]], region: str, chunk: int, last: bool) -> None:
        self.engine: EngineLoop | None = None
        self.requests, self.region, self.chunk, self.last = requests, region, chunk, last
        self.sent = self.done = 0
        self.withheld = False  # the last chunk, when it is never sent
        self.steps_before_last: int | None = None  # steps the rank made before the last chunk
        self.stopping = threading.Event()

    def read(self, wait: bool, within_s: float | None = None) -> None:
        assert self.engine is not None
        n = len(self.requests)
        if self.done == (self.sent if self.withheld else n):
            self.stopping.set()
            return
        if self.sent == n or self.withheld:
            return
        k = list(range(self.sent, min(n, self.sent + self.chunk)))
        more = self.sent + len(k) < n
        if not more and not self.last:
            self.withheld = True  # the last chunk never comes
            return
        self.sent += len(k)
        if not more:
            self.steps_before_last = self.engine.scheduler.loops.steps
        runs = [StartRun(i, f"q{i}", "rollout", self.region, self.requests[i], False) for i in k]
        self.engine.put_starts(runs, more)

    def waiting(self) -> bool:
        return False


def _serve_burst(
    horizon: int, n: int, chunk: int, last: bool, hold_s: float
) -> tuple[_Burst, RankScheduler, dict[int, dict[str, Any]]]:
    captured, plan, region = _model()
    runner = NodeRunner(captured, plan, 0)
    scheduler = RankScheduler(region_walks(captured, plan, 0), joins=runner.joinable())
    requests = [_inputs(seed, horizon) for seed in range(n)]
    script = _Burst(requests, region, chunk, last)
    done: dict[int, dict[str, Any]] = {}
    transport = LocalTransport()

    def send(msg: m.Message) -> None:
        if isinstance(msg, m.RegionEvents):
            for e in msg.events:
                if isinstance(e, m.RegionDone):
                    done[e.item] = {k: transport.receive(v, "")[0] for k, v in e.outputs.items()}
                    script.done += 1

    engine = script.engine = EngineLoop(
        0, plan, runner, scheduler, transport, ObjectStore(0), send, burst_hold_s=hold_s
    )
    engine.run(script.stopping, inbox=script)
    assert sorted(done) == list(range(script.sent))
    for k in done:
        (got,) = done[k].values()
        testing.assert_outputs_match({"states": got}, captured.run(requests[k], "rollout"))
    return script, scheduler, done


@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 9), chunk=st.integers(1, 4), horizon=st.integers(1, 6))
def test_a_burst_in_chunks_steps_as_one_cohort(n: int, chunk: int, horizon: int) -> None:
    script, scheduler, _ = _serve_burst(horizon, n, chunk, last=True, hold_s=60.0)
    assert script.steps_before_last == 0  # nothing stepped before the burst's last chunk
    # every step ran the whole burst together, as one message's starts do
    assert scheduler.stats().batch_sizes == {n: horizon}
    assert scheduler.idle() and scheduler.stats().live_values == 0


def test_a_burst_whose_rest_never_comes_steps_at_the_holds_deadline() -> None:
    # the first chunk is held, then stepped alone once the hold is over: nothing is lost
    script, scheduler, done = _serve_burst(4, 3, 2, last=False, hold_s=0.01)
    assert len(done) == 2 and script.steps_before_last is None
    assert scheduler.stats().batch_sizes == {2: 4}
