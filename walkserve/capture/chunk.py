"""Chunk policies of streaming edges: when a consumer may fire, and which items it receives.

A streaming edge carries a sequence of *items* (hidden states, codec frames) along one tensor
dimension. The producer appends items one or more at a time; the policy says, from the number
of items present ``n`` and whether the producer has ``finished``, how many chunks are ready and
which items chunk ``i`` holds. Every policy has an explicit end-of-stream rule for the final
fragment (the items left over when the producer finishes): ``flush`` (emit it short), ``drop``
(discard it) or ``pad`` (emit it padded to full size with ``pad_value``). None is implicit.

    FixedChunk(K=3), n=8, finished:      [0 1 2] [3 4 5] [6 7]+flush / [6 7 p]+pad / -+drop
    SlidingWindow(W=4, S=2), n=9:        [0 1 2 3] [2 3 4 5] [4 5 6 7]  then 8: final fragment
                                                               [6 7 8]+flush / [6 7 8 p]+pad
    LeftContext(L=2, C=3), n=8:          [|0 1 2] [1 2|3 4 5] [4 5|6 7]   (context|new)
    LeftContext(L=2, C=3, first=1), n=8: [|0] [0|1 2 3] [2 3|4 5 6] [5 6|7]

A ``ChunkSpan`` names the items of one chunk as a half-open range ``[start, stop)`` of the
stream, of which the first ``context`` are left context, followed by ``pad`` padding items.
The policy owns no data; ``take`` cuts a chunk out of a tensor, ``split`` applies a policy to a
complete sequence (what eager execution and the reference interpreter do).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

import torch


class EndOfStream(enum.Enum):
    """What happens to the final fragment of a stream."""

    FLUSH = "flush"
    DROP = "drop"
    PAD = "pad"


@dataclass(frozen=True)
class ChunkSpan:
    """Items ``[start, stop)`` of the stream: ``context`` leading context items, then new
    items, then ``pad`` padding items that are not in the stream."""

    index: int
    start: int
    stop: int
    context: int = 0
    pad: int = 0

    @property
    def new_start(self) -> int:
        return self.start + self.context

    @property
    def length(self) -> int:
        """Items the consumer receives, padding included."""
        return self.stop - self.start + self.pad


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _coerce_end(end: EndOfStream | str) -> EndOfStream:
    try:
        return EndOfStream(end)
    except ValueError:
        choices = ", ".join(e.value for e in EndOfStream)
        raise ValueError(f"end must be one of {choices}, got {end!r}") from None


class ChunkPolicy:
    """Base of the three policies. Subclasses are frozen dataclasses."""

    kind: str
    end: EndOfStream
    pad_value: float

    def ready(self, n: int, finished: bool) -> int:
        """Number of chunks formable from the first ``n`` items (cumulative, from chunk 0)."""
        raise NotImplementedError

    def span(self, i: int, n: int, finished: bool) -> ChunkSpan:
        """Items of chunk ``i``; requires ``i < ready(n, finished)``."""
        raise NotImplementedError

    def retain_from(self, next_index: int) -> int:
        """First stream item that chunk ``next_index`` or a later one may still need: items
        before it can be released from the edge buffer."""
        raise NotImplementedError

    def spans(self, n: int, finished: bool) -> list[ChunkSpan]:
        return [self.span(i, n, finished) for i in range(self.ready(n, finished))]

    def _check_index(self, i: int, n: int, finished: bool) -> None:
        if not 0 <= i < self.ready(n, finished):
            raise IndexError(f"chunk {i} is not ready with {n} items (finished={finished})")

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def from_json(data: dict[str, Any]) -> ChunkPolicy:
        kind = data.get("kind")
        fields = {k: v for k, v in data.items() if k != "kind"}
        cls = _POLICIES.get(str(kind))
        if cls is None:
            raise ValueError(
                f"unknown chunk policy kind {kind!r}; expected one of {sorted(_POLICIES)}"
            )
        return cls(**fields)


@dataclass(frozen=True)
class FixedChunk(ChunkPolicy):
    """Fires every ``size`` items; the final fragment follows ``end`` (default flush)."""

    size: int
    end: EndOfStream = EndOfStream.FLUSH
    pad_value: float = 0.0
    kind: Literal["fixed"] = "fixed"

    def __post_init__(self) -> None:
        _check_positive("FixedChunk size", self.size)
        object.__setattr__(self, "end", _coerce_end(self.end))

    def ready(self, n: int, finished: bool) -> int:
        full, rest = divmod(n, self.size)
        return full + int(finished and rest > 0 and self.end is not EndOfStream.DROP)

    def span(self, i: int, n: int, finished: bool) -> ChunkSpan:
        self._check_index(i, n, finished)
        start = i * self.size
        stop = min(start + self.size, n)
        pad = self.size - (stop - start) if self.end is EndOfStream.PAD else 0
        return ChunkSpan(i, start, stop, 0, pad)

    def retain_from(self, next_index: int) -> int:
        return next_index * self.size

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "size": self.size,
            "end": self.end.value,
            "pad_value": self.pad_value,
        }


@dataclass(frozen=True)
class SlidingWindow(ChunkPolicy):
    """Windows of ``window`` items advancing by ``stride``: window ``i`` is
    ``[i*stride, i*stride + window)``. With ``n`` items there are ``0`` full windows if
    ``n < window``, else ``1 + (n - window) // stride``. When the producer finishes, items not
    yet covered by any window form the final fragment ``[k*stride, n)`` (``k`` full windows),
    which ``end`` flushes short, pads to ``window``, or drops (default: drop, as Orpheus's
    streaming decoder does)."""

    window: int
    stride: int
    end: EndOfStream = EndOfStream.DROP
    pad_value: float = 0.0
    kind: Literal["sliding"] = "sliding"

    def __post_init__(self) -> None:
        _check_positive("SlidingWindow window", self.window)
        _check_positive("SlidingWindow stride", self.stride)
        object.__setattr__(self, "end", _coerce_end(self.end))

    def full_windows(self, n: int) -> int:
        return 0 if n < self.window else 1 + (n - self.window) // self.stride

    def _has_fragment(self, n: int) -> bool:
        k = self.full_windows(n)
        covered = 0 if k == 0 else (k - 1) * self.stride + self.window
        # With stride > window, items in [covered, k*stride) fall between windows and belong
        # to none; the fragment [k*stride, n) may then be empty.
        return n > max(covered, k * self.stride) and self.end is not EndOfStream.DROP

    def ready(self, n: int, finished: bool) -> int:
        return self.full_windows(n) + int(finished and self._has_fragment(n))

    def span(self, i: int, n: int, finished: bool) -> ChunkSpan:
        self._check_index(i, n, finished)
        start = i * self.stride
        stop = min(start + self.window, n)
        pad = self.window - (stop - start) if self.end is EndOfStream.PAD else 0
        return ChunkSpan(i, start, stop, 0, pad)

    def retain_from(self, next_index: int) -> int:
        return next_index * self.stride

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "window": self.window,
            "stride": self.stride,
            "end": self.end.value,
            "pad_value": self.pad_value,
        }


@dataclass(frozen=True)
class LeftContext(ChunkPolicy):
    """Chunks of ``chunk`` new items, each preceded by up to ``context`` earlier items: chunk
    ``i`` holds new items ``[i*C, (i+1)*C)`` and context ``min(L, i*C)`` (shorter at the start
    of the stream, never padded). The final fragment follows ``end`` (default flush, as
    Qwen3-Omni's chunked code2wav decode does).

    ``first`` (default ``chunk``) sizes chunk 0 alone: a consumer that plays its output (a
    codec) starts after ``first`` items instead of ``chunk``, and later chunks keep the larger
    size that amortizes the decode. Chunk ``i >= 1`` then holds new items
    ``[F + (i-1)*C, F + i*C)``:

        LeftContext(L=2, C=3, first=1), n=8:   [|0] [0|1 2 3] [2 3|4 5 6] [5 6|7]
    """

    context: int
    chunk: int
    end: EndOfStream = EndOfStream.FLUSH
    pad_value: float = 0.0
    first: int | None = None
    kind: Literal["left_context"] = "left_context"

    def __post_init__(self) -> None:
        if not isinstance(self.context, int) or isinstance(self.context, bool) or self.context < 0:
            raise ValueError(f"LeftContext context must be an int >= 0, got {self.context!r}")
        _check_positive("LeftContext chunk", self.chunk)
        if self.first is not None:
            _check_positive("LeftContext first", self.first)
        object.__setattr__(self, "end", _coerce_end(self.end))

    @property
    def first_size(self) -> int:
        return self.chunk if self.first is None else self.first

    def _new_start(self, i: int) -> int:
        return 0 if i == 0 else self.first_size + (i - 1) * self.chunk

    def _size(self, i: int) -> int:
        return self.first_size if i == 0 else self.chunk

    def ready(self, n: int, finished: bool) -> int:
        first = self.first_size
        if n < first:
            return int(finished and n > 0 and self.end is not EndOfStream.DROP)
        full, rest = divmod(n - first, self.chunk)
        return 1 + full + int(finished and rest > 0 and self.end is not EndOfStream.DROP)

    def span(self, i: int, n: int, finished: bool) -> ChunkSpan:
        self._check_index(i, n, finished)
        new_start = self._new_start(i)
        ctx = min(self.context, new_start)
        stop = min(new_start + self._size(i), n)
        pad = self._size(i) - (stop - new_start) if self.end is EndOfStream.PAD else 0
        return ChunkSpan(i, new_start - ctx, stop, ctx, pad)

    def retain_from(self, next_index: int) -> int:
        return max(0, self._new_start(next_index) - self.context)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "context": self.context,
            "chunk": self.chunk,
            "end": self.end.value,
            "pad_value": self.pad_value,
        }
        if self.first is not None:
            data["first"] = self.first
        return data


_POLICIES: dict[str, type[ChunkPolicy]] = {
    "fixed": FixedChunk,
    "sliding": SlidingWindow,
    "left_context": LeftContext,
}


def take(
    x: torch.Tensor, span: ChunkSpan, dim: int, pad_value: float = 0.0, offset: int = 0
) -> torch.Tensor:
    """Cut ``span`` out of ``x`` along ``dim``; ``x`` holds stream items from ``offset`` on.
    Padding items are filled with ``pad_value``."""
    piece = x.narrow(dim, span.start - offset, span.stop - span.start)
    if span.pad == 0:
        return piece
    shape = list(piece.shape)
    shape[dim] = span.pad
    filler = torch.full(shape, pad_value, dtype=piece.dtype, device=piece.device)
    return torch.cat([piece, filler], dim=dim)


def split(x: torch.Tensor, policy: ChunkPolicy, dim: int) -> list[tuple[torch.Tensor, ChunkSpan]]:
    """Apply ``policy`` to the complete sequence ``x`` (the producer has finished)."""
    n = x.shape[dim]
    return [(take(x, s, dim, policy.pad_value), s) for s in policy.spans(n, finished=True)]
