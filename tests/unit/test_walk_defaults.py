"""Walk inputs with defaults: a walk method's scalar parameter defaults are recorded in the IR
(``WalkInput.default``, serialized), and a request that leaves such an input out runs with the
default in the reference interpreter, the batched runner, the conductor (``run_local``) and
the HTTP input decoder; results checked against eager calls of the walk method."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.api import jsontensor
from walkserve.capture import iterations, loop, walk
from walkserve.capture.errors import CaptureError
from walkserve.capture.serialize import from_json, to_json
from walkserve.lowering.lower import lower
from walkserve.runtime.local import run_local


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    @walk
    def go(self, x: torch.Tensor, steps: int, scale: float = 2.0, shift: int = 3) -> dict:
        outs = []
        for _ in iterations(steps):
            x = self.step(x, scale, shift)
            outs.append(x)
        return {"y": torch.cat(outs, dim=0)}

    @loop(max_iters="steps")
    def step(self, x: torch.Tensor, scale: float, shift: int) -> torch.Tensor:
        return torch.tanh(self.lin(x) * scale + shift)


def test_defaults_are_captured_and_used_everywhere() -> None:
    model = Scaled()
    x = torch.randn(1, 4)
    captured = capture.trace(model, {"x": x, "steps": 3})
    inputs = {i.name: i.default for i in captured.graph.walks["go"].inputs}
    assert inputs == {"x": None, "steps": None, "scale": 2.0, "shift": 3}
    assert (
        from_json(to_json(captured.graph)).walks["go"].inputs == captured.graph.walks["go"].inputs
    )

    with torch.no_grad():
        default = model.go(x, 3)["y"]
        given = model.go(x, 3, 0.5, -1)["y"]
    assert torch.equal(captured.run({"x": x, "steps": 3})["y"], default)
    assert torch.equal(captured.run({"x": x, "steps": 3, "scale": 0.5, "shift": -1})["y"], given)

    plan = lower(captured, {"x": x, "steps": 3})
    requests = {"a": {"x": x, "steps": 3}, "b": {"x": x, "steps": 3, "scale": 0.5, "shift": -1}}
    result = run_local(captured, plan, requests)
    assert result.failed == {}
    assert torch.allclose(result.outputs["a"]["y"], default)
    assert torch.allclose(result.outputs["b"]["y"], given)

    decoded = jsontensor.decode_inputs(captured, "go", {"x": x.tolist(), "steps": 3, "shift": 1})
    assert decoded["scale"] == 2.0 and decoded["shift"] == 1
    with pytest.raises(ValueError, match="needs inputs"):
        jsontensor.decode_inputs(captured, "go", {"x": x.tolist()})


def test_a_non_scalar_default_is_a_capture_error() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @walk
        def go(self, x: torch.Tensor, extra: Any = (1, 2)) -> dict:
            return {"y": self.lin(x)}

    with pytest.raises(CaptureError, match="must be an int, float or bool"):
        capture.trace(Bad(), {"x": torch.ones(1, 2)})
