"""The rank scheduler (``runtime.rankscheduler``) and the regions pass (``lowering.regions``).

Three kinds of tests:

- the regions a placement gives: which runs of a walk one rank holds, what crosses them;
- fabricated runner output: a region run driven with made-up results reports nothing before its
  exit but its streamed items (in order), then its outputs; the stop ends the loop where it
  says; cancel and drop free everything;
- real runs with hypothesis: random arrivals, budgets (so random stop points), batch limits and
  cancellations, through the conductor and one rank scheduler in this process, give every
  request that was not cancelled the reference interpreter's outputs, and hold nothing after.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from walkserve import capture, testing
from walkserve.adapters.examples import build_example, example_placement
from walkserve.capture import component, iterations, loop, stream, walk
from walkserve.capture.chunk import EndOfStream, SlidingWindow
from walkserve.lowering.lower import lower
from walkserve.lowering.placement import Placement
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.conductor import Conductor, Failed, Output
from walkserve.runtime.local import LocalExecutor
from walkserve.runtime.rankreports import RegionDone, RegionOutput, RegionStreamed
from walkserve.runtime.rankscheduler import RankScheduler
from walkserve.runtime.regionwalk import region_walks
from walkserve.runtime.runner import ItemResult

CACHE: dict[tuple[str, int], tuple[capture.CapturedModel, ExecutablePlan, dict[str, Any]]] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest


def setup(
    name: str, ranks: int = 1
) -> tuple[capture.CapturedModel, ExecutablePlan, dict[str, Any]]:
    if (name, ranks) not in CACHE:
        model, sample = build_example(name)
        captured = capture.trace(model, sample)
        placement = Placement.from_file(example_placement(name, ranks)) if ranks > 1 else None
        CACHE[(name, ranks)] = (
            captured,
            lower(captured, sample, placement, check_capture=False),
            sample,
        )
    return CACHE[(name, ranks)]


# ------------------------------------------------------------------------------ regions


def test_one_rank_makes_every_walk_one_region() -> None:
    _, plan, _ = setup("example-speech")
    (region,) = plan.regions["speak"]
    assert region.rank == 0 and region.path == []
    assert region.items == [n.name for n in plan.walks["speak"].nodes]
    assert region.streamed == ["talk_step.code.all", "decode_chunk.out0.all"]
    assert region.trip_inputs == ["max_new_tokens"] and region.inputs == ["prompt_ids"]
    assert "region" in plan.format()


def test_a_stream_between_ranks_goes_region_to_region() -> None:
    _, plan, _ = setup("example-speech", 2)
    thinker, talker = plan.regions["speak"]
    assert (thinker.rank, talker.rank) == (0, 1)
    assert "think_step" in thinker.items and talker.items == ["talk_step", "decode_chunk"]
    assert thinker.forwards == ["think_step.out3.all"] and talker.fed == ["stream.talk_step"]
    # The talker needs only its initial caches: it starts while the thinker runs.
    assert "think_step.out3.all" not in talker.inputs


def test_a_loop_across_ranks_is_driven_by_the_conductor() -> None:
    _, plan, _ = setup("example-cfg-image", 2)
    regions = plan.regions.get("generate", [])
    assert all("euler_step" not in r.items for r in regions)
    # Its per-step values stay on the ranks; the conductor needs only what a client gets.
    assert plan.conductor_values["generate"] == ["decoder"]


def test_the_plan_names_the_ranks_that_may_read_each_value() -> None:
    """``plan.readers``: a node's readers are the ranks of the nodes that read it, a value
    streamed into another region's loop is read by that loop's rank, and a value that leaves
    the walk (a client's, or the next walk's) is not listed: any rank may read it."""
    from walkserve.capture import dataflow
    from walkserve.lowering.valueflow import value_readers

    for name, ranks in (("example-speech", 2), ("example-cfg-image", 2)):
        captured, plan, _ = setup(name, ranks)
        for walk_name, ir_walk in captured.graph.walks.items():
            readers = plan.readers[walk_name]
            outputs = {r for a in ir_walk.outputs.values() for r in dataflow.arg_refs(a)}
            assert not outputs & set(readers)
            by_op = {op: n.ranks for n in plan.nodes(walk_name) for op in n.ops}
            for value, names in value_readers(ir_walk).items():
                if value in outputs:
                    continue
                for reader in names & set(by_op):
                    assert set(by_op[reader]) <= set(readers[value]), (value, reader)
    _, plan, _ = setup("example-speech", 2)
    assert plan.readers["speak"]["think_step.out3.all"] == [1]  # the talker's stream
    assert set().union(*map(set, plan.readers["speak"].values())) == {0, 1}


@component
class _Tanh(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h)


class _Carried(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.step, self.head = _Tanh(), _Tanh()

    @walk
    def run(self, h: torch.Tensor, steps: int) -> dict[str, Any]:
        for _ in iterations(steps):
            h = self.turn(h)
        return {"y": self.head(h)}

    @loop
    def turn(self, h: torch.Tensor) -> torch.Tensor:
        return self.step(h)  # type: ignore[no-any-return]


def test_a_loop_body_output_is_read_where_its_terminal_channel_is() -> None:
    """A body output of a loop the conductor drives becomes the next iteration's carried
    value and, after the last one, the terminal channel read after the loop: its readers are
    the body's rank and that reader's (whose bytes the conductor routes there from the body)."""
    model, sample = _Carried().eval(), {"h": torch.randn(1, 4), "steps": 3}
    captured = capture.trace(model, sample)
    placement = Placement.from_dict({"ranks": 2, "nodes": {"step": [0], "head": [1]}})
    plan = lower(captured, sample, placement, check_capture=False, regions=False)
    (loop_node,) = captured.graph.walks["run"].body.nodes[:1]
    (body_output,) = loop_node.outputs  # type: ignore[union-attr]
    assert plan.readers["run"][body_output] == [0, 1]
    assert plan.readers["run"]["h"] == [0]  # the carried value's first iteration only


# ------------------------------------------------------------------- fabricated results


def decode_scheduler(fast_loops: bool = True) -> tuple[RankScheduler, str]:
    captured, plan, _ = setup("example-text")
    regions = region_walks(captured, plan, 0)
    return RankScheduler(regions, speculate=False, fast_loops=fast_loops), "decode"


def fabricated(scheduler: RankScheduler, step_items: Any, stop_at: int) -> list[ItemResult]:
    """Results for decode steps: iteration i's token is [[i]], the stop true at ``stop_at``
    (an item of the loop stepper, or of a frame of the rank's conductor)."""
    out = []
    for it in step_items:
        found = scheduler.loops.describe(it.id)
        i = found[1] if found is not None and not hasattr(it, "frame") else it.frame[0]
        values: dict[str, Any] = {op: torch.zeros(1) for op in it.outputs or it.ops}
        for op in values:
            if op.endswith("/argmax"):
                values[op] = torch.tensor([[i]])
            if op.endswith("/all_1"):
                values[op] = torch.tensor(i == stop_at)
        out.append(ItemResult(it.id, values))
    return out


@pytest.mark.parametrize("fast_loops", [True, False])
def test_a_region_run_reports_only_its_stream_and_its_exit(fast_loops: bool) -> None:
    scheduler, walk = decode_scheduler(fast_loops)
    inputs = {"token": torch.zeros(1, 1), "k_cache": "k", "v_cache": "v", "max_new_tokens": 9}
    scheduler.start(7, "req", walk, "region0", inputs)
    reports = []
    steps = 0
    while not scheduler.idle():
        for step in scheduler.schedule():
            steps += 1
            scheduler.update(step, fabricated(scheduler, step.items, stop_at=4))
        reports += scheduler.reports()
    streamed = [r for r in reports if isinstance(r, RegionStreamed)]
    assert [r.index for r in streamed] == [0, 1, 2, 3, 4]  # the stop's iteration counts
    assert all(r.item == 7 for r in reports)
    assert not any(isinstance(r, RegionOutput) for r in reports[: len(streamed)])
    (done,) = [r for r in reports if isinstance(r, RegionDone)]
    assert torch.equal(done.outputs["decode_step.token.all"], torch.tensor([[0, 1, 2, 3, 4]]))
    assert reports[-1] == done and steps == 5
    assert scheduler.stats().runs == 0 and scheduler.stats().live_values == 0


@pytest.mark.parametrize("fast_loops", [True, False])
def test_a_step_whose_update_raised_fails_its_runs_and_the_rank_serves_on(
    fast_loops: bool,
) -> None:
    scheduler, walk = decode_scheduler(fast_loops)
    inputs = {"token": torch.zeros(1, 1), "k_cache": "k", "v_cache": "v", "max_new_tokens": 9}
    scheduler.start(7, "a", walk, "region0", inputs)
    (step,) = scheduler.schedule()

    def boom(*args: Any) -> None:
        raise RuntimeError("boom")

    # the engine loop's case: update raises part way (in the commit, or in the conductor)
    target = scheduler.loops if fast_loops else scheduler.conductor
    name = "_commit" if fast_loops else "complete_all"
    setattr(target, name, boom)
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.update(step, fabricated(scheduler, step.items, stop_at=2))
    delattr(target, name)
    scheduler.fail_step(step, "rank 0: boom")
    assert [(type(r).__name__, r.item) for r in scheduler.reports()] == [("RegionFailed", 7)]
    assert scheduler.idle() and scheduler.stats().live_values == 0
    scheduler.start(8, "b", walk, "region0", inputs)
    while not scheduler.idle():
        for step in scheduler.schedule():
            scheduler.update(step, fabricated(scheduler, step.items, stop_at=2))
    assert isinstance(scheduler.reports()[-1], RegionDone)


@pytest.mark.parametrize("fast_loops", [True, False])
def test_cancel_and_drop_free_runs(fast_loops: bool) -> None:
    scheduler, walk = decode_scheduler(fast_loops)
    inputs = {"token": torch.zeros(1, 1), "k_cache": "k", "v_cache": "v", "max_new_tokens": 50}
    scheduler.start(1, "a", walk, "region0", inputs)
    scheduler.start(2, "b", walk, "region0", inputs)
    scheduler.start(3, "b", walk, "region0", inputs)
    for step in scheduler.schedule():
        scheduler.update(step, fabricated(scheduler, step.items, stop_at=99))
    assert {r.item for r in scheduler.reports()} == {1, 2, 3}  # their first tokens
    assert scheduler.stats().runs == 3
    scheduler.cancel("b")
    assert scheduler.stats().runs == 1
    scheduler.drop([1])
    assert scheduler.idle() and scheduler.stats().live_values == 0
    assert scheduler.schedule() == []
    # Unknown regions and bad inputs fail their run at once, nothing else.
    scheduler.start(4, "c", walk, "nope", inputs)
    scheduler.start(5, "c", walk, "region0", {"token": torch.zeros(1, 1)})
    failed = scheduler.reports()
    assert [r.item for r in failed] == [4, 5] and scheduler.idle()


# -------------------------------------------------------------------------- real runs


def drive(
    name: str,
    ranks: int,
    requests: dict[str, dict[str, Any]],
    arrivals: dict[str, int],
    cancels: dict[str, int],
    max_batch: int | None,
    limit: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, str], Conductor, LocalExecutor]:
    captured, plan, _ = setup(name, ranks)
    conductor = Conductor(captured, plan, stream_buffer_limit=limit)
    executor = LocalExecutor(captured, plan, max_batch, stream_buffer_limit=limit)
    outputs: dict[str, dict[str, Any]] = {rid: {} for rid in requests}
    failed: dict[str, str] = {}
    rounds = 0
    while rounds < 10_000:
        for rid, at in arrivals.items():
            if at == rounds:
                conductor.submit(rid, requests[rid])
        for rid, at in cancels.items():
            if at == rounds:
                conductor.cancel(rid)
                executor.ranks.cancel(rid)
        executor.report(conductor, executor.run(conductor.ready()))
        for e in conductor.events():
            if isinstance(e, Output):
                outputs[e.request][e.name] = e.value
            elif isinstance(e, Failed):
                failed[e.request] = e.error
        rounds += 1
        if rounds > max(arrivals.values()) and conductor.idle() and executor.idle():
            break
    return outputs, failed, conductor, executor


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(["example-text", "example-speech", "example-world"]),
    two_ranks=st.booleans(),
    n=st.integers(1, 6),
    arrive=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    cancel=st.lists(st.one_of(st.none(), st.integers(0, 8)), min_size=6, max_size=6),
    max_batch=st.one_of(st.none(), st.integers(1, 3)),
    seed=st.integers(0, 1000),
)
def test_random_arrivals_cancels_and_batch_limits_give_the_interpreters_outputs(
    name: str,
    two_ranks: bool,
    n: int,
    arrive: list[int],
    cancel: list[int | None],
    max_batch: int | None,
    seed: int,
) -> None:
    ranks = 2 if two_ranks and name == "example-speech" else 1
    captured, _, sample = setup(name, ranks)
    reqs = testing.mixed_requests(name, sample, n, seed=seed)
    requests = {f"r{i}": r for i, r in enumerate(reqs)}
    arrivals = {f"r{i}": arrive[i] for i in range(n)}
    cancels = {f"r{i}": c for i, c in enumerate(cancel[:n]) if c is not None and c >= arrive[i]}
    outputs, failed, conductor, executor = drive(
        name, ranks, requests, arrivals, cancels, max_batch, limit=5
    )
    assert failed == {}
    for rid, r in requests.items():
        if rid in cancels:
            continue
        testing.assert_outputs_match(outputs[rid], captured.run(r))
    assert conductor.idle() and conductor.stats().live_values == 0
    assert executor.ranks.idle() and executor.ranks.stats().live_values == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_producer_region_waits_for_its_consumer_regions_credit(stream: bool) -> None:
    """Thinker on rank 0, talker on rank 1: the talker's rank is never stepped, so the
    thinker commits as many items as one buffer holds, then waits; stepped again, both finish
    with the interpreter's outputs. A request that streams nothing to its client
    (``stream=False``) still has its stream between the ranks forwarded."""
    captured, plan, sample = setup("example-speech", 2)
    limit = 5
    request = dict(sample, max_new_tokens=16, prompt_ids=torch.tensor([[3, 4, 5, 6]]))
    conductor = Conductor(captured, plan, stream_buffer_limit=limit)
    thinker = RankScheduler(region_walks(captured, plan, 0), stream_buffer_limit=limit)
    talker = RankScheduler(region_walks(captured, plan, 1), stream_buffer_limit=limit)
    executor = LocalExecutor(captured, plan, stream_buffer_limit=limit)
    runner = executor.runner
    conductor.submit("a", request, stream=stream)
    forwarded = 0
    held: list[Any] = []

    def rounds(n: int, talker_runs: bool) -> None:
        nonlocal forwarded
        for _ in range(n):
            for it in conductor.ready():
                rank = thinker if it.node == "region0" else talker
                rank.start(it.id, it.request, it.walk, it.node, it.env, stream=it.stream)
            for rank in (thinker, talker) if talker_runs else (thinker,):
                for step in rank.schedule():
                    rank.update(step, runner.run(step.walk, step.node, step.items))
            reports = thinker.reports() + talker.reports()
            for rep in reports:
                if isinstance(rep, RegionStreamed):
                    forwarded += rep.channel == "think_step.out3.all"
                    conductor.streamed(rep.item, rep.channel, rep.index, rep.value)
                elif isinstance(rep, RegionOutput):
                    conductor.partial(rep.item, rep.outputs)
                elif isinstance(rep, RegionDone):
                    conductor.complete(rep.item, rep.outputs)
                elif hasattr(rep, "base"):
                    conductor.consumed(rep.item, rep.stream, rep.base, rep.received, rep.closed)
                else:
                    raise AssertionError(rep)
            for feed in conductor.feeds():
                held.append(feed) if not talker_runs else talker.feed(
                    feed.item, feed.stream, feed.pieces, feed.finished
                )
            for credit in conductor.credits():
                thinker.credit(credit.item, credit.channel, credit.items)

    rounds(40, talker_runs=False)
    assert forwarded == limit  # held back by the credit it started with
    for feed in held:
        talker.feed(feed.item, feed.stream, feed.pieces, feed.finished)
    rounds(200, talker_runs=True)
    outputs = {e.name: e.value for e in conductor.events() if isinstance(e, Output)}
    testing.assert_outputs_match(outputs, captured.run(request), bitwise=True)
    assert conductor.idle() and thinker.idle() and talker.idle()


@pytest.mark.parametrize("limit", [5, 64])
def test_a_rank_local_producer_streams_into_a_loop_the_conductor_drives(limit: int) -> None:
    """The thinker on rank 0 alone, talker and codec on replicas of ranks 0 and 1: the talker
    loop is the conductor's (a replicated consumer), and the thinker's loop stays a region of
    rank 0 that feeds it item by item (``RegionPlan.feeds``) within the conductor's credit,
    instead of being dispatched node by node; outputs are the interpreter's."""
    from walkserve.runtime.local import run_local

    model, sample = build_example("example-speech")
    captured = capture.trace(model, sample)
    placement = Placement.from_dict(
        {"ranks": 2, "nodes": {"thinker": [0], "talker": [0, 1], "codec": [0, 1]}}
        | {"replicas": {"talker": 2, "codec": 2}}
    )
    plan = lower(captured, sample, placement, check_capture=False)
    (thinker,) = [r for r in plan.regions["speak"] if "think_step" in r.items]
    assert thinker.rank == 0 and thinker.feeds == ["stream.talk_step"]
    assert "think_step.out3.all" in thinker.forwards
    assert all("talk_step" not in r.items for r in plan.regions["speak"])
    assert "streams stream.talk_step to the conductor" in plan.format()
    reqs = {
        f"r{k}": dict(sample, max_new_tokens=n, prompt_ids=torch.tensor([[3 + k, 4, 5, 6]]))
        for k, n in enumerate([16, 9, 1])
    }
    result = run_local(captured, plan, reqs, walks="speak", stream_buffer_limit=limit)
    assert result.failed == {}
    for rid, r in reqs.items():
        testing.assert_outputs_match(result.outputs[rid], captured.run(r, "speak"))
    think = [d for d in result.dispatches if d.node.startswith("think_step/")]
    assert think and all(d.region for d in think)  # stepped by the rank, never the conductor
    talk = [d for d in result.dispatches if d.node.startswith("talk_step/")]
    assert talk and not any(d.region for d in talk)
    assert result.max_buffered <= max(limit, 8)  # the producer waited for credit
    assert result.rank_values == 0


@component
class _Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.net(torch.cat([x, h], -1)))
        return h[:, None, :1], h  # an item [B, 1, 1] of the stream, the next state


@component
class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4 + 4, 2)

    def forward(self, window: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([window[..., 0], h], -1))  # [B, 4, 1], [B, 4] -> [B, 2]


class _LateConsumer(nn.Module):
    """A consumer loop that needs its producer's last state: it cannot start before the
    producer ends, so the stream between them has no backpressure."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = _Cell()
        self.decoder = _Decoder()

    @walk
    def speak(self, x: torch.Tensor, h: torch.Tensor, steps: int) -> dict[str, Any]:
        items = []
        for _ in iterations(steps):
            h, item = self.think(h, x)
            items.append(item)
        seq = torch.cat(items, dim=1)  # [B, steps, 1]
        last = torch.tanh(h)  # the producer's last state, made after it ends
        windows = stream(seq, SlidingWindow(4, 2, EndOfStream.PAD), dim=1)
        return {"audio": torch.cat([self.decode(w, last) for w in windows], dim=1)}

    @loop
    def think(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        item, h = self.cell(x, h)
        return h, item

    @loop
    def decode(self, window: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(window, h)  # type: ignore[no-any-return]


def test_a_region_feeding_a_consumer_that_waits_for_its_end_is_not_held_by_credit() -> None:
    """The producer region's stream exceeds the buffer limit and its consumer (on replicas,
    the conductor's) needs the producer's last state: the producer gets unlimited credit
    (it would wait forever for a consumer that waits for it), and outputs are the
    interpreter's."""
    from walkserve.runtime.local import run_local

    torch.manual_seed(0)
    model = _LateConsumer().eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    sample = {"x": torch.randn(1, 4, generator=g), "h": torch.randn(1, 4, generator=g)}
    captured = capture.trace(model, {**sample, "steps": 5})
    placement = Placement.from_dict(
        {"ranks": 2, "nodes": {"cell": [0], "decoder": [0, 1]}, "replicas": {"decoder": 2}}
    )
    plan = lower(captured, {**sample, "steps": 5}, placement, check_capture=False)
    (producer,) = [r for r in plan.regions["speak"] if "think" in r.items]
    assert producer.feeds  # the producer stays a region of rank 0
    reqs = {f"r{n}": {**sample, "steps": n} for n in (13, 6)}
    result = run_local(captured, plan, reqs, walks="speak", stream_buffer_limit=4)
    assert result.failed == {}
    for rid, r in reqs.items():
        testing.assert_outputs_match(result.outputs[rid], captured.run(r, "speak"))
