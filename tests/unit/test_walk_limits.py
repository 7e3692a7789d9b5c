"""Bounded work (``runtime.limits``): a request's input lengths, loop bounds and rows against a
server's limits, checked before admission; each refusal names the input, its value and the
limit, and what the limits accept runs as eager PyTorch does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_walk_inputs import Cell, Embed
from torch import nn

from walkserve import capture
from walkserve.capture import Input, InputError, iterations, loop, walk
from walkserve.runtime.limits import WalkLimits, check_limits, fan_out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.cell = Cell()

    @walk(inputs={"frames": Input(dims={1: "dynamic"})})
    def run(self, ids, frames, steps: int, limit: int):
        # ids: [B, T] token ids; frames: [B, F, 4], F chosen by the request; weights: [4, 4]
        h = self.embed(ids) + frames.mean(dim=1)
        outs = []
        for _ in iterations(steps):  # at most ``limit`` iterations (max_iters)
            h, done = self.step(h)
            outs.append(h)
            if done:
                break
        return {"h": torch.cat(outs, dim=0)}

    @walk
    def curve(self, x, points: int):
        outs = [x]
        for k in range(points - 1):
            x = self.smooth(x, k)
            outs.append(x)
        return {"h": torch.cat(outs, dim=0)}

    @loop
    def smooth(self, h, k):
        return self.cell(h) + 0.01 * k

    @loop(max_iters="limit")
    def step(self, h):
        h = self.cell(h)
        return h, (h.sum() > 1e9).all()


SAMPLE: dict[str, Any] = {
    "ids": torch.tensor([[1, 2, 3]]),
    "frames": torch.randn(1, 2, 4),
    "steps": 3,
    "limit": 10,
    "x": torch.randn(1, 4),
    "points": 3,
}
LIMITS = WalkLimits(max_input_length=8, max_loop_bound=20, max_batch=4)


@pytest.fixture(scope="module")
def graph() -> Any:
    return capture.trace(Model(), SAMPLE).graph


def test_within_the_limits_requests_pass_and_run_as_eager(graph: Any) -> None:
    captured = capture.trace(Model(), SAMPLE)
    for change in (
        {},
        {"ids": torch.zeros(4, 8, dtype=torch.long), "frames": torch.randn(4, 8, 4)},  # at max
        {"steps": 20, "limit": 20, "points": 21},  # every loop at its bound
        {"steps": 500, "limit": 20},  # max_iters caps the trip count under the bound
    ):
        inputs = dict(SAMPLE, **change)
        for w in ("run", "curve"):
            check_limits(graph, w, inputs, LIMITS)
            args = {i.name: inputs[i.name] for i in captured.walk(w).inputs}
            eager = dict(args, steps=min(args["steps"], args["limit"])) if w == "run" else args
            want = getattr(Model(), w)(**eager)["h"]  # eager Python has no max_iters: cap it
            torch.testing.assert_close(captured.run(args, w)["h"], want, rtol=1e-5, atol=1e-6)


BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "long ids": (
        {"ids": torch.zeros(1, 100_000, dtype=torch.long)},
        "ids",
        "dimension 1 is 100000",
    ),
    "long dynamic dim": ({"frames": torch.randn(1, 9, 4)}, "frames", "at most 8"),
    "trip count": ({"steps": 30, "limit": 40}, "steps", "steps = 30 makes loop step run up to 30"),
    "max_iters": ({"steps": 41, "limit": 25}, "limit", "limit = 25 makes loop step"),
    "expression": ({"points": 22}, "points", "points - 1 = 21"),
    "rows": ({"ids": torch.zeros(5, 2, dtype=torch.long)}, "ids", "has 5 rows"),
}


@pytest.mark.parametrize("case", BAD)
def test_over_a_limit_is_an_input_error_naming_the_input_and_the_limit(
    graph: Any, case: str
) -> None:
    change, name, words = BAD[case]
    with pytest.raises(InputError) as e:
        check_limits(graph, "curve" if name == "points" else "run", dict(SAMPLE, **change), LIMITS)
    assert e.value.input == name and e.value.rule == "limit"
    assert words in str(e.value)


def test_per_input_lengths_and_no_limits(graph: Any) -> None:
    long = dict(SAMPLE, ids=torch.zeros(1, 50, dtype=torch.long), steps=10**6)
    check_limits(graph, "run", long, WalkLimits())  # none: the captured rules alone
    check_limits(graph, "run", long, WalkLimits(max_input_length=8, input_lengths={"ids": 64}))
    with pytest.raises(InputError, match="at most 16"):
        check_limits(graph, "run", long, WalkLimits(input_lengths={"ids": 16}))
    with pytest.raises(ValueError, match="max_loop_bound must be >= 1"):
        WalkLimits(max_loop_bound=0)


def test_fan_out_counts_the_rows_of_the_batched_inputs(graph: Any) -> None:
    assert fan_out(graph, "run", SAMPLE) == 1
    rows = dict(SAMPLE, ids=torch.zeros(3, 2, dtype=torch.long), frames=torch.randn(3, 1, 4))
    assert fan_out(graph, "run", rows) == 3
