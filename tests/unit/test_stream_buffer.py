"""``frames.Stream.extend``: several pieces at once (the items a rank's fast lane held for a
request that streams nothing out) leave a stream buffer exactly as appending them one by one
does (pieces, sizes, count, every chunk a policy cuts), for ``cat`` and ``stack`` sources, any
chunk dim, negative ones included; pieces of another layout are taken one by one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve import testing
from walkserve.capture import ir
from walkserve.capture.chunk import EndOfStream, SlidingWindow
from walkserve.capture.loopsem import LoopError
from walkserve.runtime.frames import Stream
from walkserve.runtime.walkspec import StreamSpec


def _stream(mode: str, dim: int) -> Stream:
    """A stream chunked along the dim its source accumulates along (as capture makes it)."""
    window = SlidingWindow(4, 2, EndOfStream.PAD)
    acc = ir.Accumulated(0, mode, dim)  # type: ignore[arg-type]
    edge = ir.StreamEdge("s", "loop.acc", "consumer", dim, window.to_json())
    return Stream(StreamSpec(edge, window, "loop", acc, backpressure=True))


def _same(a: Stream, b: Stream) -> None:
    assert (a.n, list(a.sizes), a.dim) == (b.n, list(b.sizes), b.dim)
    assert all(torch.equal(x, y) for x, y in zip(a.pieces, b.pieces, strict=True))


@settings(max_examples=60, deadline=None)
@given(
    layout=testing.accumulation_layouts(),
    counts=st.lists(st.integers(1, 6), min_size=1, max_size=4),  # pieces per extend
    seed=st.integers(0, 2**16),
)
def test_extend_is_append_of_each(
    layout: tuple[str, int, int], counts: list[int], seed: int
) -> None:
    mode, ndim, dim = layout
    g = torch.Generator().manual_seed(seed)
    shape = [1, 2, 3][:ndim]
    one, many = _stream(mode, dim), _stream(mode, dim)
    for n in counts:
        pieces = [torch.randn(shape, generator=g) for _ in range(n)]
        for p in pieces:
            one.append(p)
        many.extend(pieces)
    _same(many, one)
    one.finished = many.finished = True
    for i in range(one.ready()):
        (a, span_a), (b, span_b) = one.chunk(i), many.chunk(i)
        assert span_a == span_b and torch.equal(a, b)


def test_pieces_of_other_layouts_are_taken_one_by_one() -> None:
    """Pieces whose number of dims differs from the first's are appended one by one, as they
    arrived; a piece that is not a tensor is refused naming the stream, the pieces before it
    in (as appending one by one leaves them)."""
    one, many = _stream("cat", -1), _stream("cat", -1)
    pieces = [torch.zeros(1, 2), torch.ones(1, 1, 3), torch.ones(1, 4)]
    for p in pieces:
        one.append(p)
    many.extend(pieces)
    _same(many, one)
    s = _stream("cat", 1)
    with pytest.raises(LoopError, match="stream 's' carries list, not a tensor"):
        s.extend([torch.zeros(1, 2), [1, 2], torch.zeros(1, 2)])
    assert s.n == 2
