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
from walkserve.capture.chunk import (
    ChunkPolicy,
    EndOfStream,
    FixedChunk,
    LeftContext,
    SlidingWindow,
)
from walkserve.capture.chunk import split as chunk_split
from walkserve.capture.loopsem import LoopError
from walkserve.runtime.frames import Stream
from walkserve.runtime.stepvalues import StepBlock, StepValues
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


@settings(max_examples=80, deadline=None)
@given(
    layout=testing.accumulation_layouts(),
    parts=st.lists(  # (steps, as a block or as single pieces) per extend
        st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=4
    ),
    seed=st.integers(0, 2**16),
)
def test_a_block_of_steps_is_buffered_as_its_steps_are(
    layout: tuple[str, int, int], parts: list[tuple[int, bool]], seed: int
) -> None:
    """A ``StepBlock`` (a cohort's steps of one run, steps first) is buffered as one piece
    joined as its source joins steps; every chunk cut from it is the one appending its steps
    one by one cuts, blocks and single pieces mixed in one ``StepValues`` or not."""
    mode, ndim, dim = layout
    g = torch.Generator().manual_seed(seed)
    shape = [1, 2, 3][:ndim]
    one, many = _stream(mode, dim), _stream(mode, dim)
    values: StepValues | None = None
    for steps, blocked in parts:
        block = torch.randn([steps, 4, *shape], generator=g).narrow(1, 1, 1).squeeze(1)
        for k in range(steps):
            one.append(block[k])
        part = StepBlock(block) if blocked else list(block.unbind(0))
        if values is None:
            values = StepValues(part)
        else:
            values.add(part)
        if steps % 2:  # now and then handed over at once
            many.extend(values)
            values = None
    if values is not None:
        many.extend(values)
    assert (many.n, many.dim) == (one.n, one.dim)
    one.finished = many.finished = True
    for i in range(one.ready()):
        (a, span_a), (b, span_b) = one.chunk(i), many.chunk(i)
        assert span_a == span_b and torch.equal(a, b)


def test_step_values_read_as_their_steps() -> None:
    block = torch.arange(6.0).reshape(3, 2)
    values = StepValues([torch.zeros(2)])
    values.add(StepBlock(block))
    assert len(values) == 4
    assert torch.equal(values[2], block[1]) and torch.equal(values[-1], block[2])
    assert [v.tolist() for v in values] == [[0.0, 0.0], [0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(IndexError):
        values[4]


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


_POLICIES = st.one_of(
    st.builds(
        SlidingWindow, st.integers(1, 6), st.integers(1, 4), st.sampled_from(list(EndOfStream))
    ),
    st.builds(FixedChunk, st.integers(1, 5), st.sampled_from(list(EndOfStream))),
    st.builds(
        LeftContext, st.integers(0, 4), st.integers(1, 4), st.sampled_from(list(EndOfStream))
    ),
)


@settings(max_examples=120, deadline=None)
@given(
    policy=_POLICIES,
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=12),  # items per piece
    takes=st.lists(st.integers(0, 3), min_size=12, max_size=12),  # chunks taken after each
)
def test_chunks_as_the_consumer_takes_them_are_the_whole_sequence_cut(
    policy: ChunkPolicy, sizes: list[int], takes: list[int]
) -> None:
    """Pieces of random sizes arrive, the consumer takes chunks in between (and releases
    what it no longer needs, as a loop iteration's start does): every chunk is what the policy
    cuts from the whole sequence. A chunk that joins several pieces replaces them with the
    joined tensor, so later chunks over those items read it: they must be the same."""
    whole = torch.arange(sum(sizes), dtype=torch.float32).reshape(1, -1, 1).expand(2, -1, 3)
    want = [x for x, _ in chunk_split(whole.contiguous(), policy, dim=1)]
    edge = ir.StreamEdge("s", "loop.acc", "consumer", 1, policy.to_json())
    s = Stream(StreamSpec(edge, policy, "loop", ir.Accumulated(0, "cat", 1), backpressure=True))
    got: list[torch.Tensor] = []

    def take(most: int) -> None:
        while most and len(got) < s.ready():
            x, _ = s.chunk(len(got))
            got.append(x.clone())
            s.release(policy.retain_from(len(got)))
            for piece in s.pieces:  # a view of a cut piece holds at most twice its bytes
                held = piece.untyped_storage().nbytes()
                assert held <= 2 * piece.numel() * piece.element_size()
            most -= 1

    at = 0
    for k, n in enumerate(sizes):
        s.append(whole[:, at : at + n].contiguous())
        at += n
        take(takes[k])
    s.finished = True
    take(-1)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), i


def test_a_window_sliding_over_one_long_piece_copies_its_tail_once_per_halving() -> None:
    """Releasing the items before each window keeps a view of the piece's tail until the
    memory under it is more than twice the tail (then a copy): a window sliding over a long
    piece copies it O(log n) times, not once per window (quadratic in the piece's length)."""
    n = 1024
    policy = SlidingWindow(4, 1, EndOfStream.DROP)
    edge = ir.StreamEdge("s", "loop.acc", "consumer", 1, policy.to_json())
    s = Stream(StreamSpec(edge, policy, "loop", ir.Accumulated(0, "cat", 1), backpressure=True))
    whole = torch.arange(n, dtype=torch.float32).reshape(1, n)
    s.append(whole.clone())
    s.finished = True
    copies, storage = 0, s.pieces[0].untyped_storage().data_ptr()
    for i in range(s.ready()):
        x, _ = s.chunk(i)
        assert torch.equal(x, whole[:, i : i + 4]), i
        s.release(policy.retain_from(i + 1))
        now = s.pieces[0].untyped_storage().data_ptr()
        copies += now != storage
        storage = now
    assert copies <= 10  # log2(1024): each copy at least halves what the piece holds


def test_a_later_piece_that_does_not_join_fails_only_the_chunk_that_reads_it() -> None:
    """A chunk joining pieces joins the later ones too where they fit; a later piece of
    another shape leaves the chunk as it was, and fails the chunk that reads it."""
    s = _stream("cat", 1)  # SlidingWindow(4, 2, PAD)
    for p in [torch.zeros(1, 2), torch.ones(1, 2), torch.ones(2, 2)]:
        s.append(p)
    x, _ = s.chunk(0)
    assert torch.equal(x, torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    s.release(s.spec.policy.retain_from(1))
    with pytest.raises(RuntimeError):
        s.chunk(1)
