"""Glue functions (``capture.gluefn``): a registered Python function called on traced values is
one glue op of the Walk Graph, runs per request like any glue (equal to eager), fuses into the
preceding component's dispatch, and an IR may name no other Python function."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from walkserve import capture
from walkserve.capture import component, iterations, loop, walk
from walkserve.capture.convert import resolve_function
from walkserve.capture.gluefn import fusible, glue_function
from walkserve.lowering.lower import lower
from walkserve.lowering.plan import LoopPlan, NodePlan


@glue_function
def noisy_pick(logits: Tensor, seed: int, step: Tensor) -> Tensor:
    """Python control flow and a generator per row: what fx cannot trace."""
    picks = []
    for r in range(logits.shape[0]):
        if seed == 0:
            picks.append(int(logits[r].argmax()))
        else:
            g = torch.Generator().manual_seed(seed * 1000 + int(step[r]))
            picks.append(int(torch.multinomial(logits[r].softmax(-1), 1, generator=g)))
    return torch.tensor(picks).unsqueeze(1)  # [B, 1]


@component(engine="stateless")
class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, token: Tensor) -> Tensor:  # [B, 1] -> [B, 16]
        return self.out(self.embed(token[:, 0]))


class Picker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = Head()

    @walk
    def run(self, token: Tensor, steps: int, seed: int) -> dict[str, Tensor]:
        count = token * 0
        out = []
        for _ in iterations(steps):
            token, count = self.step(token, count, seed)
            out.append(token)
        return {"tokens": torch.cat(out, dim=1)}

    @loop
    def step(self, token: Tensor, count: Tensor, seed: int) -> tuple[Tensor, Tensor]:
        return noisy_pick(self.head(token), seed, count), count + 1


def sample() -> dict[str, Any]:
    return {"token": torch.tensor([[3], [5]]), "steps": 6, "seed": 7}


def test_a_glue_function_is_one_op_that_runs_like_eager() -> None:
    model = Picker()
    captured = capture.trace(model, sample())
    step = next(n for n in captured.graph.walks["run"].body.nodes if hasattr(n, "body"))
    ops = [op.target for op in step.body.nodes]
    assert f"function:{__name__}.noisy_pick" in ops
    for seed in (0, 7, 8):
        request = {**sample(), "seed": seed}
        got = captured.run(request, walk="run")["tokens"]
        assert torch.equal(got, model.run(**request)["tokens"])
    assert not torch.equal(
        captured.run(sample(), walk="run")["tokens"],
        captured.run({**sample(), "seed": 0}, walk="run")["tokens"],
    )


def test_it_fuses_into_the_component_before_it() -> None:
    captured = capture.trace(Picker(), sample())
    assert fusible(f"function:{__name__}.noisy_pick")
    plan = lower(captured, sample(), check_capture=False)
    loop_plan = next(n for n in plan.walks["run"].nodes if isinstance(n, LoopPlan))
    nodes = loop_plan.body.nodes
    assert len(nodes) == 1 and isinstance(nodes[0], NodePlan) and nodes[0].kind == "component"
    assert any(op.endswith("noisy_pick") for op in nodes[0].ops)


def test_an_ir_can_name_no_other_python_function() -> None:
    assert resolve_function(f"{__name__}.noisy_pick") is noisy_pick
    with pytest.raises(ValueError, match="outside the allowed modules"):
        resolve_function(f"{__name__}.sample")
    with pytest.raises(ValueError, match="outside the allowed modules"):
        resolve_function("os.system")
    with pytest.raises(ValueError, match="module-level"):

        @glue_function
        def inner(x: Tensor) -> Tensor:
            return x
