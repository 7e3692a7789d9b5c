"""``loopsem.Steps``: consecutive pieces of an accumulated channel held as one tensor (what a
dissolving cohort leaves each run) join exactly as the pieces they stand for, in any mix with
single pieces, for ``cat`` and ``stack`` channels and any dimension, negative ones included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve import testing
from walkserve.capture import ir
from walkserve.capture.loopsem import Steps, loop_channels


def _node(mode: str, dim: int) -> ir.LoopNode:
    return ir.LoopNode(
        "loop",
        ir.Block([], []),
        [],
        ["out"],
        {},
        {"acc": ir.Accumulated(0, mode, dim)},  # type: ignore[arg-type]
        ir.FixedTrips(1),
    )


@settings(max_examples=60, deadline=None)
@given(
    layout=testing.accumulation_layouts(),
    runs=st.lists(st.integers(1, 4), min_size=1, max_size=5),  # pieces per segment
    blocks=st.lists(st.booleans(), min_size=5, max_size=5),  # which segments are Steps
    seed=st.integers(0, 2**16),
    run_major=st.booleans(),  # the block laid out steps after rows (as seal stacks), or first
)
def test_steps_join_as_the_pieces_they_stand_for(
    layout: tuple[str, int, int], runs: list[int], blocks: list[bool], seed: int, run_major: bool
) -> None:
    """A channel of plain pieces and ``Steps`` (a cohort's rows of several steps: a view of a
    block that holds another run's rows too) joins as the pieces it stands for, into a
    contiguous tensor. A channel that is one ``Steps`` may be a view of the run's own rows;
    writing to it leaves the other run's rows alone."""
    mode, ndim, dim = layout
    g = torch.Generator().manual_seed(seed)
    shape = [2, 3, 4][:ndim]
    pieces = [torch.randn(shape, generator=g) for _ in range(sum(runs))]
    mixed: list[object] = []
    wides: list[torch.Tensor] = []
    at = 0
    for n, as_block in zip(runs, blocks):
        seg = pieces[at : at + n]
        at += n
        if as_block:  # a cohort's rows: a view of a larger block, as dissolve makes
            rows = [torch.cat([p, torch.zeros_like(p)], dim=0) for p in seg]
            if run_major:
                wide = torch.stack(rows, 1)
                mixed.append(Steps(wide.narrow(0, 0, shape[0]).movedim(1, 0)))
            else:
                wide = torch.stack(rows)
                mixed.append(Steps(wide.narrow(1, 0, shape[0])))
            wides.append(wide)
        else:
            mixed += seg
    node = _node(mode, dim)
    want = (torch.cat if mode == "cat" else torch.stack)(pieces, dim=dim)
    got = loop_channels(node, {}, [None], {"acc": mixed})["acc"]
    assert got.shape == want.shape
    assert torch.equal(got, want)
    assert got.is_contiguous()
    if len(mixed) == 1 and isinstance(mixed[0], Steps):  # may be a view of its own rows
        got.add_(1.0)
        other = wides[0].narrow(0 if run_major else 1, shape[0], shape[0])
        assert torch.equal(other, torch.zeros_like(other))
    else:
        assert all(got.data_ptr() != getattr(p, "block", p).data_ptr() for p in mixed)  # a copy
