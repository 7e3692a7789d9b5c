"""A cohort's ``dissolve`` (its joint values cut into every run's rows by one op per value)
gives each run exactly its own rows: carried values, last outputs and accumulated pieces equal
the rows ``narrow`` takes at the run's offset, for several runs of 1-3 rows, batch dims 0 and
1, pieces that stack (same shape every step) and pieces that do not, and values with no batch
dim (shared by every run). Fabricated cohorts, no model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.capture import ir
from walkserve.capture.loopsem import Steps, loop_channels
from walkserve.runtime.loopcohort import Cohort


def _spec(batch: int | None) -> Any:
    return SimpleNamespace(
        outputs=("out", "aux"),
        out_dims={"out": batch, "aux": None},
        accumulated={"ch": 0},
        carried_dims={"h": batch},
    )


def _rows(v: torch.Tensor, dim: int | None, at: int, n: int) -> torch.Tensor:
    return v if dim is None else v.narrow(dim, at, n)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    batch=st.sampled_from([0, 1, None]),
    steps=st.integers(1, 4),
    ragged=st.booleans(),
    stepped=st.booleans(),
)
def test_dissolve_gives_each_run_its_own_rows(
    rows: list[int], batch: int | None, steps: int, ragged: bool, stepped: bool
) -> None:
    total = sum(rows)
    offsets = [sum(rows[:k]) for k in range(len(rows))]

    def joint(width: int) -> torch.Tensor:
        shape = [width, 3]
        if batch is not None:
            shape[batch] = total
        return torch.randn(shape)

    carried = {"h": joint(4)}
    cohort = Cohort(_spec(batch), rows, 8, {}, carried, {}, offsets=offsets, total=total)  # type: ignore[arg-type]
    pieces = []
    if stepped:
        for s in range(steps):
            piece = joint(2 + (s % 2 if ragged else 0))
            pieces.append(piece)
            cohort.pieces.setdefault("ch", []).append(piece)
        cohort.last = [pieces[-1], torch.randn(2)]
        cohort.carried = {"h": joint(4)}
        cohort.steps = steps
    left = cohort.dissolve()
    assert len(left) == len(rows)
    node = SimpleNamespace(
        name="l", params=[], terminal={}, accumulated={"ch": ir.Accumulated(0, "stack", 0)}
    )
    for k, got in enumerate(left):
        at, n = offsets[k], rows[k]
        assert torch.equal(got.carried["h"], _rows(cohort.carried["h"], batch, at, n))
        assert got.steps == cohort.steps
        if not stepped:
            assert got.last is None and got.pieces == {}
            continue
        assert got.last is not None
        assert torch.equal(got.last[0], _rows(cohort.last[0], batch, at, n))
        assert got.last[1] is cohort.last[1]  # no batch dim: the value every run shares
        want = [_rows(p, batch, at, n) for p in pieces]
        if not ragged or steps == 1:  # pieces of one shape: the channel stacks
            joined = loop_channels(node, {}, [None], {"ch": got.pieces["ch"]})["ch"]  # type: ignore[arg-type]
            assert torch.equal(joined, torch.stack(want))
        have = got.pieces["ch"]
        if len(have) == 1 and isinstance(have[0], Steps):
            have = list(have[0].block.unbind(0))
        assert len(have) == len(want)
        for h, w in zip(have, want):
            assert torch.equal(h, w)
