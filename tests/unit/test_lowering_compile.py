"""Graph-capture checks on CPU: every example component traces into one fullgraph dynamo graph;
host syncs and data-dependent shapes are reported as not capturable."""

from __future__ import annotations

import torch
from torch import nn

from walkserve import capture
from walkserve.adapters.examples import build_example
from walkserve.lowering.compile import check_capturable, compile_plan
from walkserve.lowering.lower import lower


class HostSync(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())  # .item() waits for the device


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]  # output shape depends on values


def test_example_components_are_capturable() -> None:
    model, sample = build_example("example-speech")
    plan = lower(capture.trace(model, sample), sample, check_capture=True)
    components = [n for n in plan.nodes("speak") if n.kind == "component"]
    assert components and all(n.compile.capturable for n in components)
    assert all(not n.compile.torch_compile and not n.compile.cuda_graph for n in components)  # CPU


def test_breaks_are_reported() -> None:
    x = torch.randn(4, 3)
    ok, reason = check_capturable(HostSync(), [x], {})
    assert not ok and reason
    ok, reason = check_capturable(DataDependent(), [x], {})
    assert not ok and reason


def test_cuda_plan_uses_graphs_only_for_capturable_nodes() -> None:
    assert compile_plan("cuda", True, None).cuda_graph
    assert not compile_plan("cuda", False, "host sync").cuda_graph
    assert compile_plan("cuda", False, "host sync").torch_compile
    assert not compile_plan("cpu", True, None).torch_compile
