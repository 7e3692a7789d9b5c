"""A rank's device (``runtime.device``) and CUDA graphs at a node's first call on one
(``lowering.cudagraph.GraphOnFirstCall``), checked on the CPU: the meta device stands in for a
GPU where tensors move, a recorder stand-in for the graphs (``tests/gpu`` runs the real ones)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from walkserve.capture import component, walk
from walkserve.lowering import cudagraph
from walkserve.lowering.batched import BatchedComponent
from walkserve.lowering.cudagraph import GraphOnFirstCall
from walkserve.runtime.device import place, placed_components, rank_device, to_device

META = torch.device("meta")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)  # a component of this rank
        self.dec = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # another rank's
        self.dec.add_module("inner", nn.Linear(2, 2))  # this rank's, inside another's
        self.scale = nn.Parameter(torch.ones(4))  # the glue's
        self.register_buffer("offset", torch.zeros(4))
        self.head = nn.Module()  # no component: its tensors are the glue's too
        self.head.register_buffer("table", torch.arange(3.0))


def test_place_moves_this_ranks_components_and_the_glues_tensors_only() -> None:
    model = Model()
    place(model, {"enc", "dec.inner"}, {"dec"}, META)
    where = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert where == {
        "enc.weight": "meta",
        "enc.bias": "meta",
        "dec.0.weight": "cpu",
        "dec.0.bias": "cpu",
        "dec.1.weight": "cpu",
        "dec.1.bias": "cpu",
        "dec.inner.weight": "meta",
        "dec.inner.bias": "meta",
        "scale": "meta",
        "offset": "meta",
        "head.table": "meta",
    }
    assert isinstance(model.scale, nn.Parameter)  # still a parameter, moved in place


def test_place_on_the_cpu_changes_nothing() -> None:
    model = Model()
    before = [(t, t.data_ptr()) for t in [*model.parameters(), *model.buffers()]]
    place(model, {"enc"}, {"dec"}, torch.device("cpu"))
    after = [*model.parameters(), *model.buffers()]
    assert all(t is a and t.data_ptr() == p for (t, p), a in zip(before, after))


def test_to_device_moves_tensors_in_lists_and_tuples_and_nothing_else() -> None:
    t = torch.ones(2)
    assert to_device(t, torch.device("cpu")) is t
    size = torch.Size([2, 3])
    moved = to_device([t, (t, 3, "x"), size, None], META)
    assert moved[0].is_meta and moved[1][0].is_meta and moved[1][1:] == (3, "x")
    assert moved[2] is size and moved[3] is None


def test_rank_device() -> None:
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="rank 1: device must be"):
        rank_device("mps", 1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="rank 2: the plan runs on 'cuda' but"):
            rank_device("cuda", 2)


@component
class Proj(nn.Module):
    def __init__(self, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = Proj(4), Proj(2)

    @walk
    def run(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.dec(torch.tanh(self.enc(x)))}


def test_placed_components_are_the_targets_of_the_ranks_component_nodes() -> None:
    from walkserve.capture import trace
    from walkserve.lowering.lower import lower
    from walkserve.lowering.placement import Placement

    sample = {"x": torch.randn(1, 4)}
    captured = trace(TwoStage(), sample)
    plan = lower(captured, sample, Placement(ranks=2, rules={"enc": [0], "dec": [1]}))
    assert placed_components(plan, 0) == {"enc"}
    assert placed_components(plan, 1) == {"dec"}


class Recorder(BatchedComponent):
    """Stands in for ``GraphedComponent``: counts its calls and runs eagerly."""

    made: list[Any] = []

    def __init__(self, *args: Any) -> None:  # GraphedComponent's arguments
        name, fn, in_dims, kw_dims, out_dim, buckets, template = args
        super().__init__(name, fn, in_dims, kw_dims, out_dim)
        self.template, self.buckets_seen, self.calls = template, list(buckets), 0
        Recorder.made.append(self)

    def joined(self, call: Any, count: int) -> Any:
        self.calls += 1
        return super().joined(call, count)

    def __call__(self, batch: Any) -> list[Any]:
        self.calls += 1
        return super().__call__(batch)


def _node(record: Any) -> GraphOnFirstCall:
    lin = nn.Linear(3, 2)
    return GraphOnFirstCall("n", lin, [0], {}, 0, graph_buckets=[1, 2, 4], record=record)


def test_graphs_recorded_at_the_first_call_on_a_cuda_device_then_replayed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Recorder.made = []
    node = _node(Recorder)
    x = torch.randn(2, 3)
    with torch.no_grad():
        eager = node.fn(x)
        assert torch.equal(node.joined(([x], {}), 2), eager)  # CPU tensors: eager, no graphs
        assert Recorder.made == []
        monkeypatch.setattr(cudagraph, "_on_cuda", lambda call: True)
        assert torch.equal(node.joined(([x], {}), 2), eager)
        (rec,) = Recorder.made
        assert rec.buckets_seen == [1, 2, 4] and rec.template[0][0] is x and rec.calls == 1
        out = node([([x[:1]], {}), ([x[1:]], {})])
        assert torch.equal(torch.cat(out), eager) and rec.calls == 2
        assert len(Recorder.made) == 1  # recorded once


def test_a_recording_that_fails_leaves_the_node_eager_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tries: list[int] = []

    def broken(*args: Any) -> BatchedComponent:
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    node = _node(broken)
    monkeypatch.setattr(cudagraph, "_on_cuda", lambda call: True)
    x = torch.randn(1, 3)
    with torch.no_grad():
        assert torch.equal(node.joined(([x], {}), 1), node.fn(x))
        assert torch.equal(node([([x], {})])[0], node.fn(x))
    assert tries == [1] and node.graphed is None
    assert node.refused is not None and "stream is capturing" in node.refused
    assert "runs eagerly" in caplog.text


def test_a_plan_lowered_for_cuda_gives_its_capturable_nodes_graphs_on_first_call() -> None:
    """On this CPU host the graphs never record (the calls' tensors are on the CPU): the
    node runs eagerly, with the plain callable's results."""
    from walkserve.capture import trace
    from walkserve.lowering.callables import build_callables
    from walkserve.lowering.lower import lower

    sample = {"x": torch.randn(1, 4)}
    captured = trace(TwoStage(), sample)
    cpu = build_callables(captured, lower(captured, sample))
    cuda = build_callables(captured, lower(captured, sample, device="cuda", check_capture=True))
    assert sorted(cpu) == sorted(cuda) and len(cuda) == 2
    for key, node in cuda.items():
        assert isinstance(node, GraphOnFirstCall) and type(cpu[key]) is BatchedComponent
        x = torch.randn(3, 4)
        with torch.no_grad():
            assert torch.equal(node.joined(([x], {}), 3), cpu[key].joined(([x], {}), 3))
        assert node.graphed is None and node.refused is None


def test_the_runner_counts_each_graphed_nodes_replays_and_refusals() -> None:
    from walkserve.capture import trace
    from walkserve.lowering.lower import lower
    from walkserve.runtime.runner import NodeRunner

    sample = {"x": torch.randn(1, 4)}
    captured = trace(TwoStage(), sample)
    runner = NodeRunner(captured, lower(captured, sample, device="cuda", check_capture=True))
    keys = sorted(runner.counters())
    assert len(keys) == 4 and all(k.startswith("run:") for k in keys)
    assert set(runner.counters().values()) == {0}
