"""Loop forms beyond the examples: a bounded loop whose trip count is a walk input, per-step
ints, nested loops, accumulation with a leading value."""

from __future__ import annotations

import torch
from torch import nn

from walkserve import capture
from walkserve.capture import component, ir, iterations, loop, walk


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) + x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = Cell()

    @walk
    def bounded(self, h, xs, steps):
        outs = [h]
        for k in iterations(steps):
            h, y = self.step(h, xs[:, k], 2 * k + 1)  # per-step select and an affine int
            outs.append(y)
        return {"h": h, "all": torch.cat(outs, dim=1)}

    @loop
    def step(self, h, x, scale):
        h = self.cell(h, x) * (1.0 + 0.1 * scale)
        return h, h[:, :1]

    @walk
    def nested(self, h, xs):
        for i in range(3):
            h = self.outer(h, xs[:, i])  # xs: [1, 3, 2, 4] -> [1, 2, 4]
        return {"h": h}

    @loop
    def outer(self, h, x2):
        for j in range(2):
            h = self.inner(h, x2[:, j])
        return h

    @loop
    def inner(self, h, x):
        return self.cell(h, x)


def inputs(steps: int) -> dict:
    g = torch.Generator().manual_seed(steps)
    return {
        "h": torch.randn(1, 4, generator=g),
        "xs": torch.randn(1, 8, 4, generator=g),
        "steps": steps,
    }


def test_trip_count_from_a_walk_input() -> None:
    model = Model()
    captured = capture.trace(model, inputs(3))
    (loop_node,) = [n for n in captured.walk("bounded").body.nodes if isinstance(n, ir.LoopNode)]
    assert not loop_node.dynamic and loop_node.trips == ir.InputTrips("steps")
    roles = {p.name.split("/")[-1]: p.role for p in loop_node.params}
    assert roles["x"] == ir.PerStep(ir.SelectStep(ir.Ref("xs"), 1, 0, 1))
    assert roles["scale"] == ir.PerStep(ir.AffineStep(1, 2))
    for steps in (1, 3, 6):
        got = captured.run(inputs(steps), walk="bounded")
        want = model.bounded(**inputs(steps))
        assert torch.equal(got["h"], want["h"]) and torch.equal(got["all"], want["all"])


def test_nested_loops() -> None:
    model = Model()
    sample = {"h": torch.randn(1, 4), "xs": torch.randn(1, 3, 2, 4)}
    captured = capture.trace(model, sample, walks=["nested"])
    (outer,) = [n for n in captured.walk("nested").body.nodes if isinstance(n, ir.LoopNode)]
    (inner,) = [n for n in outer.body.nodes if isinstance(n, ir.LoopNode)]
    assert outer.trips == ir.FixedTrips(3) and inner.trips == ir.FixedTrips(2)
    assert inner.params[1].role == ir.PerStep(ir.SelectStep(ir.Ref("outer/x2"), 1, 0, 1))
    got = captured.run(sample, walk="nested")
    assert torch.equal(got["h"], model.nested(**sample)["h"])


class Handoff(nn.Module):
    """One loop's last state passed straight into the next loop, as a newcomer writes it:
    a plain second loop, and a stream consumer whose every chunk call takes it too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = Cell()

    @walk
    def twice(self, h, xs):
        for k in range(3):
            h = self.inner(h, xs[:, k])
        g = xs[:, 7]
        for _ in range(2):
            g = self.again(g, h)  # the first loop's last state, unchanged, every step
        return {"g": g}

    @walk
    def windows(self, h, xs):
        items = []
        for k in range(4):
            h = self.inner(h, xs[:, k])
            items.append(h)
        seq = torch.stack(items, dim=1)  # [1, 4, 4]
        outs = [self.mix(w, h) for w in capture.stream(seq, capture.FixedChunk(2), dim=1)]
        return {"out": torch.cat(outs, dim=1)}

    @loop
    def inner(self, h, x):
        return self.cell(h, x)

    @loop
    def again(self, g, h):
        return self.cell(g, h)

    @loop
    def mix(self, w, h):
        return self.cell(w.sum(1), h)[:, None]


def test_a_loops_last_state_passed_straight_to_the_next_loop_is_its_channel() -> None:
    """Fails with "a stream chunk is used outside a @loop body" (the chunk loop) or wrong
    values when the second loop's recorded calls keep naming the first loop's last iteration
    after that loop became one node."""
    model = Handoff().eval().requires_grad_(False)
    sample = {"h": torch.randn(1, 4), "xs": torch.randn(1, 8, 4)}
    captured = capture.trace(model, sample)
    for walk_name in ("twice", "windows"):
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            r = {"h": torch.randn(1, 4, generator=g), "xs": torch.randn(1, 8, 4, generator=g)}
            with torch.no_grad():
                want = getattr(model, walk_name)(**r)
            got = captured.run(r, walk_name)
            for k, v in want.items():
                torch.testing.assert_close(got[k], v)
