"""Every capture error names the rule, the problem, and the user's source line."""

from __future__ import annotations

import builtins
import inspect

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.capture import CaptureError, component, loop, walk


@component
class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@component
class Pair(nn.Module):
    """Returns (float state, int token) so that swapped carried values change type."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.proj(h) + tok.float())
        return h, h.argmax(-1, keepdim=True)


def line_of(fn: object, text: str) -> int:
    """The absolute line number of the first line of ``fn``'s source containing ``text``."""
    lines, start = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    for offset, line in enumerate(lines):
        if text in line:
            return start + offset
    raise AssertionError(f"{text!r} not in source")


def expect(model: nn.Module, inputs: dict, rule: str, fn: object, marker: str, words: str) -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(model, inputs)
    err = info.value
    assert err.rule == rule, str(err)
    assert words in str(err), str(err)
    assert err.source is not None and err.source.endswith(f":{line_of(fn, marker)}"), str(err)


X = {"x": torch.randn(1, 4)}


class ControlFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # marker: control
            y = y * 2
        return {"y": y}


def test_control_flow_outside_a_loop_stop() -> None:
    expect(
        ControlFlow(),
        X,
        "control-flow",
        ControlFlow.run,
        "marker: control",
        "Python control flow on a traced value",
    )


class WrongOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    @walk
    def run(self, x, tok):
        h = x
        for _ in range(3):
            tok, h = self.step(h, tok)  # marker: call
        return {"h": h, "tok": tok}

    @loop
    def step(self, h, tok):
        h, tok = self.pair(h, tok)
        return h, tok


def test_carried_values_in_the_wrong_order() -> None:
    # step(h, tok) returns (h, tok) but the caller swaps them: parameter h gets output 1.
    expect(
        WrongOrder(),
        {"x": torch.randn(1, 4), "tok": torch.tensor([[1]])},
        "carried-order",
        WrongOrder.run,
        "marker: call",
        "carried values returned in the wrong order",
    )


class SwappedTypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    @walk
    def run(self, x, tok):
        h = x
        for _ in range(3):
            h, tok = self.step(h, tok)  # marker: call
        return {"h": h, "tok": tok}

    @loop
    def step(self, h, tok):
        h, tok = self.pair(h, tok)
        return tok, h  # returned in the wrong order, consistently used: types swap


def test_carried_value_that_changes_type() -> None:
    expect(
        SwappedTypes(),
        {"x": torch.randn(1, 4), "tok": torch.tensor([[1]])},
        "carried-consistency",
        SwappedTypes.run,
        "marker: call",
        "changes from float32[1, 4] to int64[1, 1]",
    )


class NoMaxIters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        for _ in range(10):
            x = self.step(x)
            if x.sum() > 1:  # marker: stop
                break
        return {"x": x}

    @loop
    def step(self, x):
        return self.lin(x)


def test_dynamic_loop_without_max_iters() -> None:
    expect(
        NoMaxIters(), X, "dynamic-loop-max-iters", NoMaxIters.run, "marker: stop", "no max_iters"
    )


class UnusedComponent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()
        self.other = Lin()

    @walk
    def run(self, x):
        self.other(x)  # marker: unused
        return {"y": self.lin(x)}


def test_component_whose_output_is_unused() -> None:
    expect(
        UnusedComponent(),
        X,
        "unused-component",
        UnusedComponent.run,
        "marker: unused",
        "is never used",
    )


class Nothing(nn.Module):
    @walk
    def run(self, x):  # marker: def
        return None


def test_walk_with_no_output() -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(Nothing(), X)
    assert info.value.rule == "walk-output"
    assert "returns no output" in str(info.value)
    # The walk's source is where its definition starts (the decorator line).
    assert info.value.source is not None
    assert info.value.source.endswith(f":{line_of(Nothing.run, 'marker: def') - 1}")


class Escapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        outs = []
        for _ in range(3):
            x = self.step(x)
            outs.append(x)
        return {"first": outs[0] * 1}  # marker: escape

    @loop
    def step(self, x):
        return self.lin(x)


def test_value_of_an_earlier_iteration_used_after_the_loop() -> None:
    expect(
        Escapes(), X, "loop-value-escapes", Escapes.run, "marker: escape", "used outside the loop"
    )


class AppendAfterStop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        outs = []
        for _ in range(10):
            x = self.step(x)
            if x.sum() > 100:
                break
            outs.append(x)
        return {"all": torch.stack(outs, 1)}  # marker: join

    @loop(max_iters=10)
    def step(self, x):
        return self.lin(x)


def test_accumulation_after_the_stop_check() -> None:
    expect(
        AppendAfterStop(),
        X,
        "accumulate",
        AppendAfterStop.run,
        "marker: join",
        "before the stop check",
    )


class Closure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x, c):
        self.c = c
        for _ in range(2):
            x = self.step(x)
        return {"x": x}

    @loop
    def step(self, x):
        return self.lin(x) + self.c  # marker: closure


def test_loop_body_reading_a_traced_value_it_was_not_given() -> None:
    expect(
        Closure(),
        {"x": torch.randn(1, 4), "c": torch.randn(1, 4)},
        "loop-body-closure",
        Closure.step,
        "marker: closure",
        "not one of its arguments",
    )


class BadPerStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x, c):
        for k in range(3):
            x = self.step(x, c * k)  # marker: call
        return {"x": x}

    @loop
    def step(self, x, ck):
        return self.lin(x) + ck


def test_per_step_value_capture_cannot_express() -> None:
    expect(
        BadPerStep(),
        {"x": torch.randn(1, 4), "c": torch.randn(1, 4)},
        "per-step-input",
        BadPerStep.run,
        "marker: call",
        "compute it inside the body",
    )


def test_model_without_walks_and_missing_inputs() -> None:
    with pytest.raises(CaptureError, match="declares no @walk"):
        capture.trace(Lin(), X)
    with pytest.raises(CaptureError, match=r"needs inputs \['c'\]"):
        capture.trace(Closure(), X)


# ---------------------------------------------------------------------- traced values


class PlainPython(nn.Module):
    """One walk per Python pattern that needs a concrete value where capture has a traced
    one. ``builtins.range`` stands for a ``range`` that capture does not patch (a helper in a
    module with no walk or loop body)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def unpatched_range(self, x, n: int):
        for _ in builtins.range(n):  # marker: error
            x = self.step(x)
        return {"x": x}

    @walk
    def int_of_tensor(self, x, n: int):
        return {"x": self.lin(x) * int(x.sum())}  # marker: error

    @walk
    def float_of_tensor(self, x, n: int):
        return {"x": self.lin(x) + float(x.mean())}  # marker: error

    @walk
    def list_comprehension(self, x, n: int):
        return {"x": torch.stack([self.lin(r) for r in x])}  # marker: error

    @walk
    def generator_expression(self, x, n: int):
        return {"x": sum(self.lin(r) for r in x)}  # marker: error

    @walk
    def seed_from_tensor(self, x, n: int):
        g = torch.Generator().manual_seed(x.sum())  # marker: error
        return {"x": self.lin(x + torch.randn(x.shape, generator=g))}

    @walk
    def trip_from_tensor(self, x, n: int):
        for _ in range(x.argmax()):  # marker: error
            x = self.step(x)
        return {"x": x}

    @loop
    def step(self, x):
        return self.lin(x)


@pytest.mark.parametrize(
    ("walk_name", "rule", "advice"),
    [
        ("unpatched_range", "python-int", "write range(n) or iterations(n)"),
        ("int_of_tensor", "python-scalar", "int() of a traced value"),
        ("float_of_tensor", "python-scalar", "float() of a traced value"),
        ("list_comprehension", "iterate-traced", "Loop over its indices instead"),
        ("generator_expression", "iterate-traced", "Loop over its indices instead"),
        ("seed_from_tensor", "rng-seed", "needs a Python int or an int walk input"),
        ("trip_from_tensor", "trip-count", "integer expression of int walk inputs"),
    ],
)
def test_no_raw_error_about_a_proxy_escapes(walk_name: str, rule: str, advice: str) -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(PlainPython(), {"x": torch.randn(2, 4), "n": 3}, walks=[walk_name])
    err = info.value
    assert err.rule == rule and advice in str(err), str(err)
    fn = getattr(PlainPython, walk_name)
    assert err.source is not None and err.source.endswith(f":{line_of(fn, 'marker: error')}")


class WithLen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        return {"x": self.lin(x) / len(x)}  # len() of a traced value is a glue op


def test_len_of_a_traced_value_is_captured() -> None:
    model = WithLen()
    x = torch.randn(3, 4)
    captured = capture.trace(model, {"x": x})
    for rows in (1, 3, 5):
        y = torch.randn(rows, 4)
        assert torch.equal(captured.run({"x": y})["x"], model.run(y)["x"])


class BadSample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        return {"y": self.lin(x[:, :3])}  # marker: fails


def test_a_sample_the_model_cannot_run_names_the_failing_line() -> None:
    # Capture runs each walk once on the sample: Lin wants 4 features, the walk passes 3.
    expect(BadSample(), X, "sample-run", BadSample.run, "marker: fails", "on the sample inputs")
