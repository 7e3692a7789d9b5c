"""Trip counts from the request: ``range(n)`` over an int walk input means ``iterations(n)``,
and a count that is an integer expression of walk inputs (``n - 1``, ``2 * n``, ``n // k``,
``range(1, n, 2)``, ``x.shape[1]``, ``len(x)``) is recorded as such (``ir.ExprTrips``),
serialized, rendered, and evaluated per request by every executor (``loopsem.loop_bound``):
the reference interpreter, the batched runner and the conductor (``run_local``) all equal the
eager method for several values."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.capture import CaptureError, component, ir, iterations, loop, walk
from walkserve.capture.loopsem import LoopError, eval_int, format_int, loop_bound
from walkserve.capture.render import render_text
from walkserve.capture.serialize import from_json, to_json
from walkserve.lowering.lower import lower
from walkserve.runtime.local import run_local
from walkserve.testing import assert_outputs_match


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class Counted(nn.Module):
    """One walk per trip-count form; each accumulates its steps, so the count is visible."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = Cell()

    def _run(self, h: torch.Tensor, ks: Any) -> dict[str, torch.Tensor]:
        outs = [h]
        for k in ks:
            h = self.step(h, k)
            outs.append(h)
        return {"all": torch.cat(outs, dim=0)}

    @walk
    def plain(self, h, n: int):
        return self._run(h, range(n))

    @walk
    def minus_one(self, h, n: int):
        return self._run(h, range(n - 1))

    @walk
    def twice(self, h, n: int):
        return self._run(h, range(2 * n))

    @walk
    def per_k(self, h, n: int, k: int):
        return self._run(h, range(n // k))

    @walk
    def strided(self, h, n: int):
        return self._run(h, range(1, n, 2))

    @walk
    def explicit(self, h, n: int):
        return self._run(h, iterations(n + 1))

    @walk
    def by_size(self, h, xs):
        return self._run(h, range(xs.shape[1]))

    @walk
    def by_len(self, h, xs):
        return self._run(h, range(len(xs) * 2 - 1))

    @loop
    def step(self, h, k):
        return self.cell(h) + 0.01 * k


H = torch.randn(1, 4, generator=torch.Generator().manual_seed(1))
CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], ir.TripCount]] = {
    "plain": ({"n": 3}, [{"n": 1}, {"n": 5}], ir.InputTrips("n")),
    "minus_one": (
        {"n": 4},
        [{"n": 2}, {"n": 7}],
        ir.ExprTrips(ir.IntBinOp("sub", ir.IntInput("n"), ir.IntLit(1))),
    ),
    "twice": (
        {"n": 2},
        [{"n": 1}, {"n": 3}],
        ir.ExprTrips(ir.IntBinOp("mul", ir.IntLit(2), ir.IntInput("n"))),
    ),
    "per_k": (
        {"n": 7, "k": 2},
        [{"n": 9, "k": 3}, {"n": 5, "k": 5}],
        ir.ExprTrips(ir.IntBinOp("floordiv", ir.IntInput("n"), ir.IntInput("k"))),
    ),
    "strided": ({"n": 6}, [{"n": 2}, {"n": 9}], None),  # type: ignore[dict-item]
    "explicit": (
        {"n": 2},
        [{"n": 0}, {"n": 4}],
        ir.ExprTrips(ir.IntBinOp("add", ir.IntInput("n"), ir.IntLit(1))),
    ),
    "by_size": (
        {"xs": torch.zeros(1, 3)},
        [{"xs": torch.zeros(1, 1)}, {"xs": torch.zeros(1, 6)}],
        ir.ExprTrips(ir.IntSize("xs", 1)),
    ),
    "by_len": ({"xs": torch.zeros(2, 1)}, [{"xs": torch.zeros(3, 1)}], None),  # type: ignore[dict-item]
}


def loop_of(captured: capture.CapturedModel, walk_name: str) -> ir.LoopNode:
    (node,) = [n for n in captured.walk(walk_name).body.nodes if isinstance(n, ir.LoopNode)]
    return node


@pytest.mark.parametrize("walk_name", list(CASES))
def test_trip_count_forms_equal_eager(walk_name: str) -> None:
    sample, others, trips = CASES[walk_name]
    model = Counted()
    captured = capture.trace(model, {"h": H, **sample}, walks=[walk_name])
    node = loop_of(captured, walk_name)
    assert not node.dynamic
    if trips is not None:
        assert node.trips == trips
    for extra in [sample, *others]:
        inputs = {"h": H, **extra}
        want = getattr(model, walk_name)(**inputs)["all"]
        assert torch.equal(captured.run(inputs, walk_name)["all"], want), extra
    # The IR round-trips through JSON and lints.
    assert from_json(to_json(captured.graph)) == captured.graph
    captured.lint()


def test_strided_range_count_and_indices() -> None:
    model = Counted()
    captured = capture.trace(model, {"h": H, "n": 6}, walks=["strided"])
    node = loop_of(captured, "strided")
    assert isinstance(node.trips, ir.ExprTrips)
    assert format_int(node.trips.expr) == "(n - 1 + 1) // 2"
    roles = {p.name.rpartition("/")[2]: p.role for p in node.params}
    assert roles["k"] == ir.PerStep(ir.AffineStep(1, 2))  # k = 1, 3, 5, ...
    for n in range(0, 10):
        assert loop_bound(node, {"n": n}, None) == len(range(1, n, 2))


def test_all_executors_evaluate_the_expression_per_request() -> None:
    model = Counted()
    sample = {"h": H, "n": 4}
    captured = capture.trace(model, sample, walks=["minus_one"])
    plan = lower(captured, sample, check_capture=False)
    requests = {f"r{n}": {"h": H * (n + 1), "n": n} for n in (2, 3, 4, 7)}
    result = run_local(captured, plan, requests)  # batched runner + conductor
    assert result.failed == {}
    for rid, inputs in requests.items():
        want = model.minus_one(**inputs)
        # Batched calls of several requests sum in another order: within 1e-5 of max|want|.
        assert_outputs_match(result.outputs[rid], want)
        assert_outputs_match(captured.run(inputs, "minus_one"), want, bitwise=True)


def test_a_count_the_loop_cannot_run_is_refused_before_admission() -> None:
    # The loop accumulates, so it must run once (zero iterations would leave its channel
    # empty): n = 1 makes n - 1 = 0 iterations, and the check says so before any node runs.
    captured = capture.trace(Counted(), {"h": H, "n": 4}, walks=["minus_one"])
    with pytest.raises(capture.InputError) as info:
        capture.check_inputs(captured.walk("minus_one"), {"h": H, "n": 1})
    assert info.value.input == "n" and info.value.rule == "trip-count"
    assert "runs n - 1 times, which is 0 for n = 1; it must be in [1, 16777216]" in str(info.value)
    capture.check_inputs(captured.walk("minus_one"), {"h": H, "n": 2})


def test_rendered_and_evaluated() -> None:
    captured = capture.trace(Counted(), {"h": H, "n": 7, "k": 2}, walks=["per_k"])
    assert "loop step x (n // k) (of walk inputs)" in render_text(captured.graph, "per_k")
    expr = ir.IntBinOp(
        "sub",
        ir.IntBinOp("mul", ir.IntLit(2), ir.IntBinOp("add", ir.IntInput("a"), ir.IntLit(1))),
        ir.IntBinOp("sub", ir.IntInput("b"), ir.IntSize("x", 1)),
    )
    assert format_int(expr) == "2 * (a + 1) - (b - x.shape[1])"
    assert eval_int(expr, {"a": 3, "b": 5, "x": torch.zeros(1, 2)}) == 2 * 4 - (5 - 2)
    with pytest.raises(LoopError, match="divides by zero"):
        eval_int(ir.IntBinOp("floordiv", ir.IntInput("a"), ir.IntLit(0)), {"a": 1})
    with pytest.raises(LoopError, match="must be an int"):
        eval_int(ir.IntInput("a"), {"a": 1.5})


class Dynamic(nn.Module):
    """A data-dependent stop inside ``range(n - 1)``: the expression bounds the loop."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = Cell()

    @walk
    def run(self, h, n: int):
        outs = []
        for _ in range(n - 1):
            h, done = self.step(h)
            outs.append(h)
            if done:
                break
        return {"all": torch.cat(outs, dim=0)}

    @loop
    def step(self, h):
        h = self.cell(h)
        return h, (h.sum() > 100).all()


def test_dynamic_loop_bounded_by_an_expression() -> None:
    model = Dynamic()
    captured = capture.trace(model, {"h": H, "n": 5})
    node = loop_of(captured, "run")
    assert node.dynamic and node.max_iters is None and isinstance(node.trips, ir.ExprTrips)
    for n in (2, 6):
        want = model.run(H, n)["all"]
        assert torch.equal(captured.run({"h": H, "n": n})["all"], want)


class Reversed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = Cell()

    @walk
    def run(self, h, n: int):
        for k in reversed(range(n)):  # marker: reversed
            h = self.step(h, k)
        return {"h": h}

    @loop
    def step(self, h, k):
        return self.cell(h) * k


class Computed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = Cell()

    @walk
    def run(self, h, n: int):
        for _ in range(n * h.shape[0] + (h.sum() > 0)):  # marker: computed
            h = self.step(h)
        return {"h": h}

    @loop
    def step(self, h):
        return self.cell(h)


@pytest.mark.parametrize(
    ("model", "rule", "words"),
    [
        (Reversed(), "range", "Iterate forward"),
        (Computed(), "trip-count", "integer expression of int walk inputs"),
    ],
)
def test_unsupported_range_forms_are_capture_errors(
    model: nn.Module, rule: str, words: str
) -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(model, {"h": H, "n": 3})
    assert info.value.rule == rule and words in str(info.value)
    assert info.value.source is not None and "test_capture_trips.py" in info.value.source
