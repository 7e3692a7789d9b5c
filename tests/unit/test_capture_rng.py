"""Random numbers in walks (``capture.rng``): a ``torch.Generator`` made and seeded inside a
walk, from a constant or a walk input, and passed to torch's random functions, is captured as
state threaded through one glue op per draw. Each request's draws equal eager PyTorch's for
the same seed and sequence of draws, in the reference interpreter and in the conductor with
batched components (``run_local``); the patterns capture refuses are ``CaptureError``s that
name the line and the rule and show the supported way."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.capture import CaptureError, component, loop, walk
from walkserve.lowering.lower import lower
from walkserve.runtime.local import run_local
from walkserve.testing import assert_outputs_match


def line_of(fn: object, text: str) -> int:
    """The absolute line number of the first line of ``fn``'s source containing ``text``."""
    lines, start = inspect.getsourcelines(inspect.unwrap(fn))  # type: ignore[arg-type]
    return start + next(i for i, line in enumerate(lines) if text in line)


@component
class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Draws(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def from_input(self, x, seed: int):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(x.shape[0], 4, generator=g)  # traced size
        b = torch.rand(2, 3, generator=g)  # constant size: still one draw per request
        c = torch.randint(0, 10, (x.shape[0], 2), generator=g)
        d = torch.normal(0.0, 2.0, size=(1, 4), generator=g)
        e = torch.randn_like(x, generator=g)
        f = torch.empty_like(x).normal_(generator=g)  # in place on a traced tensor
        h = self.lin(x + a + d + e + f)
        return {"h": h, "b": b, "c": c}

    @walk
    def constant_seed(self, x):
        g = torch.Generator()
        g.manual_seed(1234)
        return {"h": self.lin(x * torch.randn(x.shape, generator=g))}

    @walk
    def seed_expression(self, x, seed: int):
        g = torch.Generator().manual_seed(seed + 7)
        return {"h": self.lin(torch.randn(x.shape[0], 4, generator=g))}

    @walk
    def loop_noise(self, x, seed: int, steps: int):
        # The supported way to have noise per step: draw it before the loop and index it.
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(steps, x.shape[0], 4, generator=g)
        for k in range(steps):
            x = self.step(x, noise[k])
        return {"x": x}

    @loop
    def step(self, x, eps):
        return torch.tanh(self.lin(x)) + 0.1 * eps


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    ("walk_name", "sample", "requests"),
    [
        ("from_input", {"seed": 3}, [{"seed": 4}, {"seed": 2**40}, {"seed": -5}]),
        ("constant_seed", {}, [{}]),
        ("seed_expression", {"seed": 1}, [{"seed": 9}]),
        ("loop_noise", {"seed": 1, "steps": 3}, [{"seed": 2, "steps": 5}]),
    ],
)
def test_draws_equal_eager_per_request(walk_name: str, sample: dict, requests: list) -> None:
    model = Draws()
    captured = capture.trace(model, {"x": X, **sample}, walks=[walk_name])
    for extra in [sample, *requests]:
        inputs = {"x": X, **extra}
        with torch.no_grad():
            want = getattr(model, walk_name)(**inputs)
        assert_outputs_match(captured.run(inputs, walk_name), want, bitwise=True)


def test_requests_served_by_the_conductor_draw_their_own_streams() -> None:
    model = Draws()
    sample = {"x": X, "seed": 3}
    captured = capture.trace(model, sample, walks=["from_input"])
    plan = lower(captured, sample, check_capture=False)
    requests = {f"r{s}": {"x": X[: 1 + s % 2], "seed": s} for s in range(4)}
    result = run_local(captured, plan, requests)
    assert result.failed == {}
    for rid, inputs in requests.items():
        with torch.no_grad():
            want = model.from_input(**inputs)
        assert_outputs_match(result.outputs[rid], want)
        assert torch.equal(result.outputs[rid]["c"], want["c"])  # integer draws exactly


class InLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x, seed: int):
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            x = self.step(x, g)
        return {"x": x}

    @loop
    def step(self, x, g):
        return self.lin(x) + torch.randn(x.shape, generator=g)  # marker: error


class Unseeded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        g = torch.Generator()
        g.seed()  # marker: error
        return {"x": self.lin(x)}


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()
        self.g = torch.Generator().manual_seed(0)

    @walk
    def run(self, x):
        return {"x": self.lin(x + torch.randn(x.shape, generator=self.g))}  # marker: error


class OnDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        g = torch.Generator(device="cuda")  # marker: error
        return {"x": self.lin(x + torch.randn(x.shape, generator=g))}


class InPlaceConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        g = torch.Generator().manual_seed(0)
        noise = torch.empty(2, 4).normal_(generator=g)  # marker: error
        return {"x": self.lin(x + noise)}


class ToComponent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = Lin()

    @walk
    def run(self, x):
        g = torch.Generator().manual_seed(0)
        return {"x": self.lin(x, g)}  # marker: error


@pytest.mark.parametrize(
    ("model", "rule", "advice"),
    [
        (InLoop(), "rng-in-loop", "Draw every iteration's noise before the loop"),
        (Unseeded(), "rng-seed", "Seed it from the request instead"),
        (Shared(), "rng-generator", "Make and seed the generator inside the walk"),
        (OnDevice(), "rng-device", "draw on the CPU and move the tensor"),
        (InPlaceConstant(), "rng-in-place", "draw a new tensor instead"),
        (ToComponent(), "rng-generator", "only torch's random functions may take it"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None,
)
def test_unsupported_rng_is_a_capture_error_with_the_supported_way(
    model: nn.Module, rule: str, advice: str
) -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(model, {"x": X, "seed": 1})
    err = info.value
    assert err.rule == rule, str(err)
    assert advice in str(err), str(err)
    fn = getattr(type(model), "step", None) if rule == "rng-in-loop" else type(model).run
    assert err.source is not None and err.source.endswith(f":{line_of(fn, 'marker: error')}")
