"""Property tests of the chunk policies in ``walkserve.capture.chunk``.

Each policy is checked against a brute-force model written from its docstring: the model lists,
for every chunk, the stream items it holds (context first) and how many padding items follow.
The tests then compare ``ready``/``span``/``split``/``take``/``retain_from`` with the model and
check the streaming properties the runtime relies on: a chunk once ready never changes, and a
buffer that releases items before ``retain_from`` still holds everything later chunks need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from walkserve.capture.chunk import (
    ChunkPolicy,
    EndOfStream,
    FixedChunk,
    LeftContext,
    SlidingWindow,
    split,
    take,
)

FAST = settings(max_examples=100, deadline=None)
TENSOR = settings(max_examples=60, deadline=None)

# ---------------------------------------------------------------------------------------------
# Strategies

sizes = st.integers(min_value=1, max_value=8)
contexts = st.integers(min_value=0, max_value=8)
ends = st.sampled_from(list(EndOfStream))
pad_values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
item_counts = st.integers(min_value=0, max_value=40)
finished_flags = st.booleans()

fixed_chunks = st.builds(FixedChunk, size=sizes, end=ends, pad_value=pad_values)
sliding_windows = st.builds(
    SlidingWindow, window=sizes, stride=sizes, end=ends, pad_value=pad_values
)
left_contexts = st.builds(
    LeftContext,
    context=contexts,
    chunk=sizes,
    end=ends,
    pad_value=pad_values,
    first=st.one_of(st.none(), sizes),  # a smaller (or larger) chunk 0
)
policies = st.one_of(fixed_chunks, sliding_windows, left_contexts)


# ---------------------------------------------------------------------------------------------
# Brute-force model: every chunk as the list of stream items it holds.


@dataclass(frozen=True)
class ModelChunk:
    items: list[int]  # stream indices, the context items first
    context: int
    pad: int


def final_fragment(
    items: list[int], context: int, full_new: int, end: EndOfStream
) -> list[ModelChunk]:
    """The final fragment as zero or one chunk; ``full_new`` is the new-item count of a full
    chunk. Only new items are padded, never context."""
    if end is EndOfStream.DROP:
        return []
    if end is EndOfStream.FLUSH:
        return [ModelChunk(items, context, 0)]
    return [ModelChunk(items, context, full_new - (len(items) - context))]


def model_fixed(policy: FixedChunk, n: int, finished: bool) -> list[ModelChunk]:
    chunks = []
    pending: list[int] = []
    for item in range(n):
        pending.append(item)
        if len(pending) == policy.size:
            chunks.append(ModelChunk(pending, 0, 0))
            pending = []
    if finished and pending:
        chunks += final_fragment(pending, 0, policy.size, policy.end)
    return chunks


def model_sliding(policy: SlidingWindow, n: int, finished: bool) -> list[ModelChunk]:
    chunks = []
    start = 0
    while start + policy.window <= n:
        chunks.append(ModelChunk(list(range(start, start + policy.window)), 0, 0))
        start += policy.stride
    covered = {item for chunk in chunks for item in chunk.items}
    tail = list(range(start, n))  # where the next window would begin, up to the end
    if finished and any(item not in covered for item in tail):
        chunks += final_fragment(tail, 0, policy.window, policy.end)
    return chunks


def model_left_context(policy: LeftContext, n: int, finished: bool) -> list[ModelChunk]:
    chunks = []
    new_start = 0
    size = policy.chunk if policy.first is None else policy.first  # chunk 0's size
    while new_start < n:
        new = list(range(new_start, min(new_start + size, n)))
        context = list(range(max(0, new_start - policy.context), new_start))
        if len(new) == size:
            chunks.append(ModelChunk(context + new, len(context), 0))
        elif finished:
            chunks += final_fragment(context + new, len(context), size, policy.end)
        new_start += size
        size = policy.chunk
    return chunks


def model(policy: ChunkPolicy, n: int, finished: bool) -> list[ModelChunk]:
    if isinstance(policy, FixedChunk):
        return model_fixed(policy, n, finished)
    if isinstance(policy, SlidingWindow):
        return model_sliding(policy, n, finished)
    assert isinstance(policy, LeftContext)
    return model_left_context(policy, n, finished)


def expected_chunk(x: torch.Tensor, chunk: ModelChunk, dim: int, pad_value: float) -> torch.Tensor:
    """The model chunk cut out of ``x`` by gathering its item indices (not by slicing)."""
    picked = x.index_select(dim, torch.tensor(chunk.items, dtype=torch.long))
    shape = list(x.shape)
    shape[dim] = chunk.pad
    return torch.cat([picked, torch.full(shape, pad_value, dtype=x.dtype)], dim=dim)


# ---------------------------------------------------------------------------------------------
# 1. SlidingWindow window count


@FAST
@given(
    window=st.integers(1, 50),
    stride=st.integers(1, 50),
    n=st.integers(0, 300),
    end=ends,
)
@example(window=2, stride=5, n=4, end=EndOfStream.FLUSH)  # stride > window, n in a gap
@example(window=4, stride=2, n=9, end=EndOfStream.DROP)  # the docstring's picture
def test_sliding_window_count(window: int, stride: int, n: int, end: EndOfStream) -> None:
    policy = SlidingWindow(window, stride, end)
    count = 0 if n < window else 1 + (n - window) // stride
    assert policy.full_windows(n) == count
    assert policy.ready(n, finished=False) == count
    assert policy.ready(n, finished=True) in (count, count + 1)


# ---------------------------------------------------------------------------------------------
# 2. Which items each chunk holds, against the model


@TENSOR
@given(policy=policies, n=item_counts, finished=finished_flags)
@example(policy=SlidingWindow(2, 5, EndOfStream.FLUSH), n=4, finished=True)
@example(policy=SlidingWindow(2, 5, EndOfStream.PAD), n=9, finished=True)
@example(policy=SlidingWindow(4, 2, EndOfStream.PAD), n=9, finished=True)
@example(policy=LeftContext(2, 3, EndOfStream.PAD), n=8, finished=True)
@example(policy=LeftContext(2, 3, EndOfStream.PAD, first=1), n=8, finished=True)
def test_spans_match_model(policy: ChunkPolicy, n: int, finished: bool) -> None:
    chunks = model(policy, n, finished)
    assert policy.ready(n, finished) == len(chunks)
    for i, chunk in enumerate(chunks):
        span = policy.span(i, n, finished)
        assert span.index == i
        assert list(range(span.start, span.stop)) == chunk.items
        assert (span.context, span.pad) == (chunk.context, chunk.pad)
        assert span.new_start == span.start + chunk.context
        assert span.length == len(chunk.items) + chunk.pad
    with pytest.raises(IndexError):
        policy.span(len(chunks), n, finished)


@TENSOR
@given(policy=policies, n=item_counts)
def test_split_1d_matches_model(policy: ChunkPolicy, n: int) -> None:
    x = torch.arange(n, dtype=torch.float64)
    chunks = model(policy, n, finished=True)
    pieces = split(x, policy, dim=0)
    assert len(pieces) == len(chunks)
    for (piece, span), chunk in zip(pieces, chunks):
        values = [float(i) for i in chunk.items] + [policy.pad_value] * chunk.pad
        assert piece.tolist() == values
        assert span == policy.span(span.index, n, finished=True)
    # Padding only ever fills out the final fragment.
    assert all(span.pad == 0 for _, span in pieces[:-1])


@TENSOR
@given(
    policy=policies,
    n=item_counts,
    lead=st.integers(1, 3),
    trail=st.one_of(st.none(), st.integers(1, 3)),
)
def test_split_along_dim_1_matches_model(
    policy: ChunkPolicy, n: int, lead: int, trail: int | None
) -> None:
    shape = (lead, n) if trail is None else (lead, n, trail)
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    chunks = model(policy, n, finished=True)
    pieces = split(x, policy, dim=1)
    assert len(pieces) == len(chunks)
    for (piece, _), chunk in zip(pieces, chunks):
        assert torch.equal(piece, expected_chunk(x, chunk, 1, policy.pad_value))


# ---------------------------------------------------------------------------------------------
# 3. ready() and FixedChunk partitioning


@FAST
@given(policy=policies, n=item_counts)
def test_ready_is_monotone_and_finishing_adds_at_most_one(policy: ChunkPolicy, n: int) -> None:
    for finished in (False, True):
        assert policy.ready(n, finished) <= policy.ready(n + 1, finished)
    assert policy.ready(n, False) <= policy.ready(n, True) <= policy.ready(n, False) + 1


@FAST
@given(policy=fixed_chunks, n=item_counts)
def test_fixed_chunks_partition_the_stream(policy: FixedChunk, n: int) -> None:
    spans = policy.spans(n, finished=True)
    items = [item for s in spans for item in range(s.start, s.stop)]
    full = n // policy.size
    kept = full * policy.size if policy.end is EndOfStream.DROP else n
    assert items == list(range(kept))  # in order, no gaps, no overlap
    assert all(s.context == 0 for s in spans)
    for s in spans[:full]:
        assert (s.stop - s.start, s.pad) == (policy.size, 0)
    fragment = spans[full:]
    if n % policy.size == 0 or policy.end is EndOfStream.DROP:
        assert fragment == []
    else:
        (last,) = fragment
        assert last.stop - last.start == n % policy.size
        assert last.length == (policy.size if policy.end is EndOfStream.PAD else n % policy.size)


# ---------------------------------------------------------------------------------------------
# 4. LeftContext


@FAST
@given(policy=left_contexts, n=item_counts)
def test_left_context_chunks(policy: LeftContext, n: int) -> None:
    spans = policy.spans(n, finished=True)
    first = policy.chunk if policy.first is None else policy.first
    new_items: list[int] = []
    for i, s in enumerate(spans):
        new_start = 0 if i == 0 else first + (i - 1) * policy.chunk
        size = first if i == 0 else policy.chunk
        assert s.new_start == new_start
        assert s.context == min(policy.context, new_start)  # short at the start, never padded
        assert list(range(s.start, s.new_start)) == list(range(new_start - s.context, new_start))
        new_items += range(s.new_start, s.stop)
        assert s.stop - s.new_start + s.pad <= size
    full = 0 if n < first else 1 + (n - first) // policy.chunk  # chunks of full size
    kept = (
        (0 if full == 0 else first + (full - 1) * policy.chunk)
        if policy.end is EndOfStream.DROP
        else n
    )
    assert new_items == list(range(kept))
    for i, s in enumerate(spans[full:], start=full):
        size = first if i == 0 else policy.chunk
        assert s.pad == (size - (s.stop - s.new_start) if policy.end is EndOfStream.PAD else 0)


@TENSOR
@given(policy=left_contexts, n=item_counts)
def test_left_context_padding_follows_the_new_items(policy: LeftContext, n: int) -> None:
    x = torch.arange(n, dtype=torch.float64)
    for piece, s in split(x, policy, dim=0):
        real = s.stop - s.start
        assert piece[:real].tolist() == [float(i) for i in range(s.start, s.stop)]
        assert piece[real:].tolist() == [policy.pad_value] * s.pad


# ---------------------------------------------------------------------------------------------
# 5. retain_from


@FAST
@given(policy=policies, n=item_counts, finished=finished_flags)
@example(policy=SlidingWindow(2, 5, EndOfStream.FLUSH), n=11, finished=True)
def test_retain_from_is_safe_and_tight(policy: ChunkPolicy, n: int, finished: bool) -> None:
    spans = policy.spans(n, finished)
    for i in range(len(spans) + 1):
        first_kept = policy.retain_from(i)
        assert all(s.start >= first_kept for s in spans[i:])
        if i < len(spans) and spans[i].stop > spans[i].start:
            assert spans[i].start == first_kept
    assert all(s.stop > s.start for s in spans)  # every chunk holds a real item
    assert all(policy.retain_from(i) <= policy.retain_from(i + 1) for i in range(len(spans) + 1))


# ---------------------------------------------------------------------------------------------
# 6. Incremental consistency


@FAST
@given(policy=policies, n=item_counts)
def test_ready_chunks_never_change(policy: ChunkPolicy, n: int) -> None:
    at_end = policy.spans(n, finished=True)
    growing = policy.spans(n, finished=False)
    for prefix in range(n + 1):
        early = policy.spans(prefix, finished=False)
        assert early == growing[: len(early)] == at_end[: len(early)]


@TENSOR
@given(policy=policies, arrivals=st.lists(st.integers(0, 7), max_size=10))
def test_streaming_with_released_buffer_matches_split(
    policy: ChunkPolicy, arrivals: list[int]
) -> None:
    """Feed items in bursts, cut every ready chunk from a buffer that keeps only items from
    ``retain_from(next chunk)`` on, and compare with ``split`` of the whole stream."""
    stream = torch.arange(sum(arrivals), dtype=torch.float64)
    buffer = stream[:0]  # holds stream items [offset, received)
    offset = received = 0
    emitted: list[torch.Tensor] = []
    for count, finished in [(a, False) for a in arrivals] + [(0, True)]:
        buffer = torch.cat([buffer, stream[received : received + count]])
        received += count
        while len(emitted) < policy.ready(received, finished):
            span = policy.span(len(emitted), received, finished)
            emitted.append(take(buffer, span, 0, policy.pad_value, offset=offset))
        keep = min(policy.retain_from(len(emitted)), received)
        assert keep >= offset  # released items are never needed again
        buffer, offset = buffer[keep - offset :], keep
    expected = [piece for piece, _ in split(stream, policy, dim=0)]
    assert len(emitted) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(emitted, expected))


# ---------------------------------------------------------------------------------------------
# 7. JSON round trip and validation


@FAST
@given(policy=policies)
def test_json_round_trip(policy: ChunkPolicy) -> None:
    data = policy.to_json()
    assert json.loads(json.dumps(data)) == data  # plain JSON values only
    again = ChunkPolicy.from_json(data)
    assert type(again) is type(policy)
    assert again == policy


def test_end_accepts_its_string_name() -> None:
    assert FixedChunk(3, "pad").end is EndOfStream.PAD  # type: ignore[arg-type]
    assert ChunkPolicy.from_json({"kind": "sliding", "window": 4, "stride": 2}) == SlidingWindow(
        4, 2, EndOfStream.DROP
    )


bad_positive = st.one_of(
    st.integers(max_value=0), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3)
)
bad_non_negative = st.one_of(
    st.integers(max_value=-1), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3)
)
VALID = {
    "fixed": {"size": 3},
    "sliding": {"window": 4, "stride": 2},
    "left_context": {"context": 2, "chunk": 3},
}


@FAST
@given(
    case=st.one_of(
        st.tuples(st.just("fixed"), st.just("size"), bad_positive),
        st.tuples(st.just("sliding"), st.sampled_from(["window", "stride"]), bad_positive),
        st.tuples(st.just("left_context"), st.just("chunk"), bad_positive),
        st.tuples(st.just("left_context"), st.just("context"), bad_non_negative),
        st.tuples(st.just("left_context"), st.just("first"), bad_positive),
    )
)
def test_bad_sizes_name_the_field(case: tuple[str, str, object]) -> None:
    kind, field, value = case
    with pytest.raises(ValueError, match=field):
        ChunkPolicy.from_json({"kind": kind, **VALID[kind], field: value})


END_NAMES = {e.value for e in EndOfStream}
bad_ends = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(max_size=6).filter(lambda e: e not in END_NAMES),
)


@FAST
@given(kind=st.sampled_from(sorted(VALID)), end=bad_ends)
def test_unknown_end_rule_names_the_field(kind: str, end: object) -> None:
    with pytest.raises(ValueError, match="end must be one of"):
        ChunkPolicy.from_json({"kind": kind, **VALID[kind], "end": end})


@FAST
@given(
    kind=st.one_of(st.none(), st.integers(), st.text(max_size=12).filter(lambda k: k not in VALID))
)
def test_unknown_kind_names_the_field(kind: object) -> None:
    with pytest.raises(ValueError, match="kind"):
        ChunkPolicy.from_json({"kind": kind, "size": 3})


def test_missing_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="kind"):
        ChunkPolicy.from_json({"size": 3})


@pytest.mark.parametrize(
    "data, key",
    [
        ({"kind": "fixed", "size": 3, "sise": 3}, "sise"),
        ({"kind": "fixed"}, "size"),
        ({"kind": "sliding", "window": 4}, "stride"),
    ],
)
def test_unknown_and_missing_keys_are_rejected(data: dict[str, object], key: str) -> None:
    # from_json passes the keys to the dataclass, which raises TypeError naming the key.
    with pytest.raises((TypeError, ValueError), match=key):
        ChunkPolicy.from_json(data)
