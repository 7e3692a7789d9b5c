"""The conductor (``walkserve.runtime.conductor``) and its in-process executor (``local``).

Two kinds of tests:

- real runs through ``run_local`` (lowered batched components, glue through the interpreter's
  ``op``) of every example walk, compared with the reference interpreter run per request.
  Integer outputs (tokens, codes) must be identical. Float outputs are compared as
  ``max|got - ref| <= 1e-5 * max|ref|``, not bitwise: requests that share a batched call are
  summed in a different order by batched kernels (a denoiser call on stacked requests differs
  from separate calls by ~1e-7, and 19 guided Euler steps carry it along). A single request
  calls every component exactly as the interpreter does and is checked bitwise.
- fabricated-result tests of the pure conductor: items are completed with made-up values
  (tagged with request, op and iteration) in chosen or random orders, which checks readiness,
  the same-request/same-iteration rule, stops, speculation and release without running a model.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from walkserve import capture, testing
from walkserve.adapters.examples import EXAMPLES, build_example, cfg_image
from walkserve.capture import component, ir, iterations, loop, stream, walk
from walkserve.capture.chunk import EndOfStream, FixedChunk, SlidingWindow
from walkserve.capture.serialize import from_json
from walkserve.lowering.lower import lower
from walkserve.lowering.plan import ExecutablePlan
from walkserve.lowering.split import fuse_elementwise
from walkserve.runtime.conductor import (
    Conductor,
    Event,
    Failed,
    Finished,
    Output,
    StreamItem,
    WorkItem,
)
from walkserve.runtime.local import LocalExecutor, run_local

CACHE: dict[
    tuple[str, str, bool], tuple[capture.CapturedModel, ExecutablePlan, dict[str, Any]]
] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest


def predicate_apart(op: Any) -> bool:
    """The default glue fusion, except a loop's stop predicate (``done.all()``): that stays a
    node of its own, dispatched after the step's component, the plan in which speculation has
    something to win (fused, the predicate arrives with the component's output)."""
    return fuse_elementwise(op) and op.target != "method:all"


def setup(
    name: str, glue: str = "fuse", regions: bool = False
) -> tuple[capture.CapturedModel, ExecutablePlan, dict[str, Any]]:
    """The example, captured and lowered; ``regions=False`` (tests of the conductor itself,
    which drive it node by node): no region is handed to a rank scheduler, as when a walk's
    nodes sit on different ranks."""
    if (name, glue, regions) not in CACHE:
        model, sample = build_example(name)
        captured = capture.trace(model, sample)
        policy = predicate_apart if glue == "predicate_apart" else glue
        plan = lower(captured, sample, check_capture=False, glue=policy, regions=regions)
        CACHE[(name, glue, regions)] = (captured, plan, sample)
    return CACHE[(name, glue, regions)]


def mixed_requests(name: str, sample: dict[str, Any], n: int) -> dict[str, dict[str, Any]]:
    """``n`` requests of different prompt lengths, token budgets, horizons and noise, by id."""
    return {f"r{i}": r for i, r in enumerate(testing.mixed_requests(name, sample, n, seed=100 + n))}


def assert_matches(got: dict[str, Any], ref: dict[str, Any], bitwise: bool) -> None:
    testing.assert_outputs_match(got, ref, bitwise=bitwise)


def joined_stream_items(
    captured: capture.CapturedModel, events: list[Event], request: str
) -> dict[str, torch.Tensor]:
    """Each streamed client output of ``request``, rebuilt from its StreamItems."""
    items: dict[str, list[StreamItem]] = {}
    for e in events:
        if isinstance(e, StreamItem) and e.request == request:
            items.setdefault(e.channel, []).append(e)
    out = {}
    for w in captured.graph.walks.values():
        for node in w.body.nodes:
            if not isinstance(node, ir.LoopNode):
                continue
            for name, arg in w.outputs.items():
                acc = node.accumulated.get(arg.name) if isinstance(arg, ir.Ref) else None
                if acc is None or name not in items:
                    continue
                got = items[name]
                assert [e.index for e in got] == list(range(len(got))), name
                join = torch.cat if acc.mode == "cat" else torch.stack
                out[name] = join([e.value for e in got], dim=acc.dim)
    return out


# --------------------------------------------------------------------------- real runs


@pytest.mark.parametrize("regions", [True, False])
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_run_local_matches_interpreter(name: str, n: int, regions: bool) -> None:
    captured, plan, sample = setup(name, regions=regions)
    requests = mixed_requests(name, sample, n)
    arrivals = {rid: i % 3 for i, rid in enumerate(requests)}  # join running batches
    for start in captured.graph.entry_walks():  # every walk: later ones follow the chain
        result = run_local(captured, plan, requests, walks=start, arrivals=arrivals)
        assert result.failed == {}
        for rid, r in requests.items():
            ref = captured.run(r, start)
            assert_matches(result.outputs[rid], ref, bitwise=n == 1)
            # Streamed outputs arrive item by item and add up to the final output.
            for key, joined in joined_stream_items(captured, result.events, rid).items():
                assert torch.equal(joined, result.outputs[rid][key]), key
            finished = [e for e in result.events if isinstance(e, Finished) and e.request == rid]
            assert len(finished) == 1
        stats = result.stats
        assert (stats.live_requests, stats.in_flight, stats.live_values) == (0, 0, 0)
        assert stats.buffered_stream_items == 0


@pytest.mark.parametrize("regions", [True, False])
def test_continuous_batching_mixes_iterations(regions: bool) -> None:
    captured, plan, sample = setup("example-speech", regions=regions)
    requests = mixed_requests("example-speech", sample, 8)
    arrivals = {rid: i % 3 for i, rid in enumerate(requests)}
    result = run_local(captured, plan, requests, arrivals=arrivals)
    assert result.failed == {}
    assert any(size > 1 for sizes in result.histogram.values() for size in sizes)
    # One call (all members compatible) shared by requests at different iterations.
    mixed = [
        d
        for d in result.dispatches
        if d.kind == "component"
        and len(d.members) > 1
        and d.calls == (len(d.members),)
        and len({frame for _, frame, _ in d.members}) > 1
    ]
    assert mixed, result.histogram
    # Requests that arrived in different rounds share calls (they joined a running batch).
    assert any(len({arrivals[rid] for rid, _, _ in d.members}) > 1 for d in mixed)


@pytest.mark.parametrize("regions", [True, False])
def test_bad_request_fails_alone_in_a_batch(regions: bool) -> None:
    captured, plan, sample = setup("example-text", regions=regions)
    requests = mixed_requests("example-text", sample, 4)
    conductor = Conductor(captured, plan)
    # Refused before admission (capture.inputs.check_inputs), naming the input and the rule.
    with pytest.raises(ValueError, match=r"'prompt_ids'.*vocabulary of lm"):
        conductor.submit("bad", dict(requests["r1"], prompt_ids=torch.tensor([[5, 999, 7]])))
    with pytest.raises(ValueError, match=r"'max_new_tokens'.*rule: kind"):
        conductor.submit("bad2", dict(requests["r1"], max_new_tokens="many"))
    assert conductor.idle()
    # A request that passes the checks and fails inside a node fails alone: a decode state
    # whose key and value caches differ in length (each length is free) breaks the lm.
    bad = decode_inputs(4)
    bad["v_cache"] = torch.cat([bad["v_cache"], bad["v_cache"]], dim=3)
    requests["bad"] = bad
    result = run_local(captured, plan, requests, walks={"bad": "decode"})
    assert set(result.failed) == {"bad"} and "lm" in result.failed["bad"]
    for rid in ("r0", "r1", "r2", "r3"):
        assert_matches(result.outputs[rid], captured.run(requests[rid]), bitwise=False)
    assert result.stats.live_values == 0


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) + x)


@component
class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h)


class Forms(nn.Module):
    """Loop forms the examples lack: nested loops (a per-step select of an outer parameter),
    a stack-accumulated dynamic producer streamed to two consumers at once, one under
    ``SlidingWindow(3, 2, end=pad)``, one under ``FixedChunk(2, end=drop)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell, self.head, self.mix = Cell(), Head(), Cell()

    @walk
    def nested(self, h: torch.Tensor, xs: torch.Tensor) -> dict[str, torch.Tensor]:
        for i in range(3):
            h = self.outer(h, xs[:, i])  # xs: [B, 3, 2, 4]
        return {"h": h}

    @loop
    def outer(self, h: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        for j in range(2):
            h = self.inner(h, x2[:, j])
        return h

    @loop
    def inner(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.cell(h, x)  # type: ignore[no-any-return]

    @walk
    def pipe(self, h: torch.Tensor, x: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        hs = []
        for _ in iterations(n):
            h, done = self.produce(h, x)
            hs.append(h)
            if done:
                break
        seq = torch.stack(hs, dim=1)  # [B, T, 4]
        wins = [self.window(w) for w in stream(seq, SlidingWindow(3, 2, EndOfStream.PAD), dim=1)]
        pairs = [self.pair(c) for c in stream(seq, FixedChunk(2, EndOfStream.DROP), dim=1)]
        return {"wins": torch.cat(wins, dim=1), "pairs": torch.stack(pairs, dim=1), "last": h}

    @loop(max_iters="n")
    def produce(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.cell(h, x)
        return h, (self.head(h) > 0.3).all()

    @loop
    def window(self, w: torch.Tensor) -> torch.Tensor:
        return self.mix(w.mean(dim=1), w[:, 0]).sum(dim=1, keepdim=True)  # type: ignore[no-any-return]

    @loop
    def pair(self, c: torch.Tensor) -> torch.Tensor:
        return self.mix(c[:, 0], c[:, 1])  # type: ignore[no-any-return]


def test_other_loop_forms_match_interpreter() -> None:
    model = Forms().eval().requires_grad_(False)
    sample = {"h": torch.randn(1, 4), "xs": torch.randn(1, 3, 2, 4), "x": torch.randn(1, 4), "n": 9}
    captured = capture.trace(model, sample)
    plans = [lower(captured, sample, check_capture=False, regions=r) for r in (True, False)]
    g = torch.Generator().manual_seed(0)
    requests = {
        f"r{k}": dict(
            sample, x=2 * torch.randn(1, 4, generator=g), h=torch.randn(1, 4, generator=g)
        )
        for k in range(6)
    }
    for plan, walk_name in itertools.product(plans, ("nested", "pipe")):
        result = run_local(captured, plan, requests, walks=walk_name, stream_buffer_limit=3)
        assert result.max_buffered <= 3 * 2 * len(requests)  # two bounded streams each
        for rid, r in requests.items():
            try:
                ref = captured.run(r, walk_name)
            except Exception as e:  # a loop that ran no iteration: the request fails alike
                assert result.failed[rid] == str(e)
                continue
            assert_matches(result.outputs[rid], ref, bitwise=False)
        assert len(result.failed) < len(requests)
        assert result.stats.live_values == 0


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("regions", [True, False])
def test_talker_starts_before_thinker_finishes(regions: bool) -> None:
    captured, plan, sample = setup("example-speech", regions=regions)
    result = run_local(captured, plan, {"a": sample})
    rounds: dict[str, list[int]] = {}
    for d in result.dispatches:
        rounds.setdefault(d.node, []).append(d.round)
    n_tokens = result.outputs["a"]["codes"].shape[1]
    assert n_tokens >= 3
    # The talker's first step is handed out by an earlier ready() than the thinker's last.
    assert min(rounds["talk_step/talker"]) < max(rounds["think_step/thinker"])
    assert min(rounds["decode_chunk/codec"]) < max(rounds["talk_step/talker"])
    codes = [e for e in result.events if isinstance(e, StreamItem) and e.channel == "codes"]
    assert len(codes) == n_tokens
    # The smallest buffer that holds a codec chunk: same results, never more buffered.
    small = run_local(captured, plan, {"a": sample}, stream_buffer_limit=5)
    assert small.max_buffered <= 5
    assert_matches(small.outputs["a"], result.outputs["a"], bitwise=True)


def long_speech_request(sample: dict[str, Any], minimum: int) -> dict[str, Any]:
    """A request whose thinker emits at least ``minimum`` tokens (found by the interpreter)."""
    captured = setup("example-speech")[0]
    g = torch.Generator().manual_seed(7)
    for _ in range(50):
        r = dict(sample, prompt_ids=torch.randint(0, 64, (1, 5), generator=g), max_new_tokens=16)
        if captured.run(r)["codes"].shape[1] >= minimum:
            return r
    raise AssertionError("no long request found")


def test_bounded_stream_buffer_holds_the_producer_back() -> None:
    captured, plan, sample = setup("example-speech")
    limit = 5  # the codec's LeftContext(2, 3) needs 5 items per chunk
    request = long_speech_request(sample, limit + 5)
    conductor = Conductor(captured, plan, stream_buffer_limit=limit)
    executor = LocalExecutor(captured, plan)
    conductor.submit("a", request)
    held: list[WorkItem] = []
    thinker_steps = 0
    for _ in range(40):  # the talker never gets its results: the thinker must stop
        items = conductor.ready()
        held += [it for it in items if it.node == "talk_step/talker"]
        run = [it for it in items if it.node != "talk_step/talker"]
        thinker_steps += sum(it.node == "think_step/thinker" for it in run)
        executor.report(conductor, executor.run(run))
        assert conductor.stats().buffered_stream_items <= limit
    assert conductor.stats().buffered_stream_items == limit
    assert len(held) == 1  # the talker's first step, waiting
    # Held back: item 0 went to the held talker step, items 1..limit wait in the buffer, and
    # no further step (speculative ones included) was started.
    assert thinker_steps == 1 + limit
    assert conductor.ready() == []
    executor.report(conductor, executor.run(held))
    while not conductor.idle():
        items = conductor.ready()
        assert items
        executor.report(conductor, executor.run(items))
        assert conductor.stats().buffered_stream_items <= 2 * limit  # two streams
    outputs = {e.name: e.value for e in conductor.events() if isinstance(e, Output)}
    assert_matches(outputs, captured.run(request), bitwise=True)


def test_stream_buffer_limit_must_hold_a_chunk() -> None:
    captured, plan, _ = setup("example-speech")
    with pytest.raises(ValueError, match="at least 5"):
        Conductor(captured, plan, stream_buffer_limit=4)


# --------------------------------------------------------------------------- fabricated


def tag(item: WorkItem, op: str) -> tuple[str, str, str, tuple[int, ...]]:
    return ("tag", item.request, op, item.frame)


def fabricate(item: WorkItem) -> dict[str, Any]:
    return {op: tag(item, op) for op in item.ops}


def tags_in(value: Any) -> list[tuple[Any, ...]]:
    if isinstance(value, tuple) and value and value[0] == "tag":
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tags_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tags_in(v)]
    return []


def check_inputs(item: WorkItem) -> None:
    """Every input is the same request's, and of this iteration, the previous one (carried),
    an enclosing scope (invariant), or an inner loop's iteration (a channel of that loop)."""
    found = tags_in(item.call) + tags_in(dict(item.env))
    for _, request, _, frame in found:
        assert request == item.request, (item, request)
        f = item.frame
        previous = (*f[:-1], f[-1] - 1) if f else None
        nested = f[: len(frame)] == frame or frame[: len(f)] == f
        assert frame == previous or nested, (item, frame)


def drive(
    conductor: Conductor,
    values: Callable[[WorkItem], dict[str, Any]] = fabricate,
    rounds: int = 10_000,
    only: str | None = None,
) -> list[list[WorkItem]]:
    """Complete every ready item (of request ``only``, if given) round by round."""
    log = []
    for _ in range(rounds):
        items = conductor.ready()
        if not items:
            break
        log.append(items)
        for it in items:
            check_inputs(it)
            if only is None or it.request == only:
                conductor.complete(it.id, values(it))
    return log


def test_parallel_branches_become_ready_together() -> None:
    captured, plan, sample = setup("example-cfg-image")
    conductor = Conductor(captured, plan)
    conductor.submit("a", sample, "edit")
    log = drive(conductor)
    first = {it.node for it in log[0] if it.kind == "component"}
    assert {"text_encoder", "image_encoder"} <= first
    branches = {"euler_step/denoiser", "euler_step/denoiser_1", "euler_step/denoiser_2"}
    for i in range(cfg_image.NUM_EULER_UPDATES):
        together = [
            {it.node for it in items if it.frame == (i,) and it.kind == "component"}
            for items in log
        ]
        assert branches in together, i
    # The guidance glue fused into denoiser_2 reads all three branches: it runs after them.
    tails = [it for items in log for it in items if it.node == "euler_step/denoiser_2"]
    assert {it.kind for it in tails} == {"component", "glue"}
    outputs = [e for e in conductor.events() if isinstance(e, Output)]
    assert [(e.name, e.value[2]) for e in outputs] == [("image", "decoder")]


def test_results_of_one_request_never_feed_another() -> None:
    captured, plan, sample = setup("example-cfg-image")
    conductor = Conductor(captured, plan)
    conductor.submit("a", sample)
    conductor.submit("b", sample)
    log = drive(conductor, rounds=12, only="a")  # b's items are never completed
    b_items = [it for items in log for it in items if it.request == "b"]
    assert b_items == [it for it in log[0] if it.request == "b"]  # b made no progress
    assert max(it.frame for items in log for it in items if it.request == "a") >= (2,)

    # Values no later node needs are released: a's live values do not grow per iteration.
    def live() -> int:
        samples = []
        for _ in range(8):
            drive(conductor, rounds=1, only="a")
            samples.append(conductor.stats().live_values_by_request["a"])
        return max(samples)

    early = live()
    drive(conductor, rounds=20, only="a")  # a's loop is still running after these
    assert live() <= early


def decode_values(stop_at: int | None) -> Callable[[WorkItem], dict[str, Any]]:
    """Fabricated decode-walk results: the token of iteration i is ``[[i]]``; the stop is
    true at iteration ``stop_at``."""

    def values(item: WorkItem) -> dict[str, Any]:
        out = fabricate(item)
        i = item.frame[0] if item.frame else -1
        for op in item.ops:
            if op.endswith("/argmax"):
                out[op] = torch.tensor([[i]])
            if op.endswith("/all_1"):
                out[op] = torch.tensor(i == stop_at)
        return out

    return values


def decode_inputs(max_new_tokens: int) -> dict[str, Any]:
    """Inputs of example-text's decode walk that pass its input checks: zeros of the captured
    shapes (the fabricated runs never read their values)."""
    captured, _, _ = setup("example-text")
    inputs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for i in captured.walk("decode").inputs:
        if isinstance(i.meta, ir.TensorMeta):
            shape = [1 if d is None else d for d in i.meta.shape]
            inputs[i.name] = torch.zeros(shape, dtype=getattr(torch, i.meta.dtype))
    return inputs


def test_stop_ends_the_loop_and_its_iteration_counts() -> None:
    captured, plan, _ = setup("example-text")
    conductor = Conductor(captured, plan)
    conductor.submit("a", decode_inputs(10), "decode")
    drive(conductor, decode_values(stop_at=3))
    events = conductor.events()
    items = [e.index for e in events if isinstance(e, StreamItem)]
    assert items == [0, 1, 2, 3]
    (out,) = [e for e in events if isinstance(e, Output)]
    assert out.name == "tokens" and torch.equal(out.value, torch.tensor([[0, 1, 2, 3]]))
    assert events[-1] == Finished("a")
    assert conductor.stats().wasted_steps <= 1 and conductor.idle()


def test_walk_transition_carries_state_by_name() -> None:
    captured, plan, _ = setup("example-text")
    conductor = Conductor(captured, plan)
    conductor.submit("a", {"prompt_ids": torch.tensor([[5, 6]]), "max_new_tokens": 2})
    log = drive(conductor, decode_values(stop_at=None))
    decode = [it for items in log for it in items if it.walk == "decode"]
    first_lm = next(it for it in decode if it.kind == "component")
    assert first_lm.call is not None
    token, k_cache, v_cache = first_lm.call[0]
    assert token[2] == "argmax" and k_cache[2] == "getitem_2" and v_cache[2] == "getitem_3"
    events = conductor.events()
    outputs = [(e.walk, e.name) for e in events if isinstance(e, Output)]
    assert outputs == [("prefill", "token"), ("prefill", "position"), ("decode", "tokens")]
    assert events[-1] == Finished("a")


def test_submit_rejects_bad_requests() -> None:
    captured, plan, sample = setup("example-text")
    conductor = Conductor(captured, plan)
    with pytest.raises(ValueError, match="max_new_tokens"):
        conductor.submit("a", {"prompt_ids": sample["prompt_ids"]})  # decode's input too
    with pytest.raises(ValueError, match="unknown walk"):
        conductor.submit("a", sample, "nope")
    conductor.submit("a", sample)
    with pytest.raises(ValueError, match="already live"):
        conductor.submit("a", sample)
    with pytest.raises(KeyError):
        conductor.complete(10_000, {})
    assert conductor.stats().live_requests == 1


def test_cancel_releases_everything() -> None:
    captured, plan, sample = setup("example-cfg-image")
    conductor = Conductor(captured, plan)
    for rid in "abc":
        conductor.submit(rid, sample)
    drive(conductor, rounds=8)
    outstanding = conductor.ready()
    assert {it.request for it in outstanding} == set("abc")
    conductor.cancel("b")
    conductor.cancel("b")  # twice: no-op
    stats = conductor.stats()
    assert "b" not in stats.live_values_by_request and stats.live_requests == 2
    assert stats.in_flight == sum(it.request != "b" for it in outstanding)
    for it in outstanding:  # b's late results are ignored
        conductor.complete(it.id, fabricate(it))
    drive(conductor)
    events = conductor.events()
    assert not [e for e in events if e.request == "b"]
    assert {e.request for e in events if isinstance(e, Finished)} == {"a", "c"}
    stats = conductor.stats()
    assert (stats.live_requests, stats.in_flight, stats.live_values) == (0, 0, 0)


def test_fail_fails_one_request_only() -> None:
    captured, plan, _ = setup("example-text")
    conductor = Conductor(captured, plan, speculate=False)
    conductor.submit("a", decode_inputs(6), "decode")
    conductor.submit("b", decode_inputs(6), "decode")
    values = decode_values(stop_at=None)
    for _ in range(3):
        for it in conductor.ready():
            conductor.complete(it.id, values(it))
    items = conductor.ready()
    bad = next(it for it in items if it.request == "a")
    conductor.fail(bad.id, "boom")
    for it in items:
        if it is not bad:
            conductor.complete(it.id, values(it))  # a's other results: ignored
    drive(conductor, values)
    events = conductor.events()
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and failed[0].request == "a" and "boom" in failed[0].error
    assert Finished("b") in events and Finished("a") not in events
    assert not [e for e in events if e.request == "a" and not isinstance(e, (StreamItem, Failed))]
    assert conductor.idle()


def test_a_failed_speculative_step_fails_only_if_it_runs() -> None:
    captured, plan, _ = setup("example-text", glue="predicate_apart")
    for stop_at, fails in ((2, False), (5, True)):
        conductor = Conductor(captured, plan)
        conductor.submit("a", decode_inputs(8), "decode")
        values = decode_values(stop_at)
        while not conductor.idle():
            items = conductor.ready()
            assert items
            for it in items:
                if it.speculative and it.frame == (3,) and it.kind == "component":
                    conductor.fail(it.id, "speculative boom")
                else:
                    conductor.complete(it.id, values(it))
        failed = [e for e in conductor.events() if isinstance(e, Failed)]
        assert bool(failed) == fails


# --------------------------------------------------------------------------- speculation


@settings(max_examples=60, deadline=None)
@given(
    plans=st.lists(
        st.tuples(st.integers(1, 8), st.one_of(st.none(), st.integers(0, 9))),
        min_size=1,
        max_size=4,
    ),
    speculate=st.booleans(),
    seed=st.integers(0, 2**16),
    together=st.booleans(),
)
def test_speculation_wastes_at_most_one_step_per_stop(
    plans: list[tuple[int, int | None]], speculate: bool, seed: int, together: bool
) -> None:
    """Random stop points, results completed in random subsets and orders, one by one or
    each subset at once (``complete_all``: one advance per request)."""
    captured, plan, _ = setup("example-text", glue="predicate_apart")
    conductor = Conductor(captured, plan, speculate=speculate)
    rng = random.Random(seed)
    stops: dict[str, int | None] = {}
    for k, (max_new, stop_at) in enumerate(plans):
        stops[f"r{k}"] = stop_at
        conductor.submit(f"r{k}", decode_inputs(max_new), "decode")
    pending: list[WorkItem] = []
    seen: list[WorkItem] = []
    while not conductor.idle():
        pending += conductor.ready()
        seen += pending
        assert pending
        rng.shuffle(pending)
        cut = rng.randint(1, len(pending))
        done, pending = pending[:cut], pending[cut:]
        results = [(it.id, decode_values(stops[it.request])(it)) for it in done]
        if together:
            conductor.complete_all(results)
        for item, value in [] if together else results:
            conductor.complete(item, value)
    events = conductor.events()
    terminations = 0
    for k, (max_new, stop_at) in enumerate(plans):
        rid = f"r{k}"
        n = max_new if stop_at is None or stop_at >= max_new else stop_at + 1
        terminations += stop_at is not None and stop_at < max_new
        streamed = [e.index for e in events if isinstance(e, StreamItem) and e.request == rid]
        assert streamed == list(range(n))
        (out,) = [e for e in events if isinstance(e, Output) and e.request == rid]
        assert torch.equal(out.value, torch.arange(n)[None])
        assert Finished(rid) in events
        # Steps past the last one were never dispatched except speculatively.
        assert all(it.speculative for it in seen if it.request == rid and it.frame >= (n,))
    stats = conductor.stats()
    assert stats.wasted_steps <= terminations
    if not speculate:
        assert stats.wasted_steps == stats.speculated_steps == 0
        assert not any(it.speculative for it in seen)
    assert (stats.live_requests, stats.in_flight, stats.live_values) == (0, 0, 0)


def test_speculation_saves_rounds() -> None:
    captured, plan, _ = setup("example-text", glue="predicate_apart")
    rounds = {}
    for speculate in (True, False):
        conductor = Conductor(captured, plan, speculate=speculate)
        conductor.submit("a", decode_inputs(8), "decode")
        rounds[speculate] = len(drive(conductor, decode_values(stop_at=5)))
        assert conductor.stats().wasted_steps == int(speculate)
    assert rounds[True] < rounds[False]


def without_speculation(captured: capture.CapturedModel, what: str) -> capture.CapturedModel:
    """A copy of the text model's graph with the decode loop (``"loop"``) or its LM
    component (``"component"``) marked non-speculative (side effects)."""
    graph = from_json(captured.to_json())
    if what == "component":
        graph.components["lm"] = msgspec.structs.replace(graph.components["lm"], speculative=False)
    else:
        (loop,) = [n for n in graph.walks["decode"].body.nodes if isinstance(n, ir.LoopNode)]
        loop.speculative = False
    return capture.CapturedModel(graph, captured.model)


@pytest.mark.parametrize("what", ["loop", "component"])
def test_non_speculative_loops_never_speculate(what: str) -> None:
    captured, plan, _ = setup("example-text", glue="predicate_apart")
    conductor = Conductor(without_speculation(captured, what), plan)
    conductor.submit("a", decode_inputs(8), "decode")
    log = drive(conductor, decode_values(stop_at=4))
    assert not any(it.speculative for items in log for it in items)
    stats = conductor.stats()
    assert stats.speculated_steps == stats.wasted_steps == 0
    assert max(it.frame for items in log for it in items) == (4,)
