"""Frames: the live state of a request inside the conductor.

One ``RequestState`` per live request; a ``Frame`` per instance of a block (the walk body, or
one iteration of a loop body) holding its values, its undispatched ops and regions, its loop
runs (``LoopRun``), its stream buffers (``Stream``) and its streams between regions
(``Forward``); a ``Pending`` per dispatched item. The conductor mutates these; nothing else
does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.chunk import ChunkSpan, take
from walkserve.capture.loopsem import LoopError
from walkserve.runtime.stepvalues import StepBlock, segments
from walkserve.runtime.walkspec import BlockSpec, LoopSpec, RegionSpec, StreamSpec
from walkserve.runtime.workitem import WorkItem


@dataclass(eq=False)
class Stream:
    """The buffer of one streaming edge in one frame: the producer's committed items, of
    which ``[base, n)`` are retained (one tensor piece per producer iteration)::

        stream items       0  1  2  3  4  5  6  7     n = 8 committed so far
        chunk 1 (L=2, C=3)    [1  2 |3  4  5]         context | new items
        after taking it, retain_from(2) = 2*3 - 2 = 4: items 0..3 are released
        retained                       [4  5  6  7]   base = 4, buffered = n - base = 4
    """

    spec: StreamSpec
    pieces: deque[torch.Tensor] = field(default_factory=deque)
    sizes: deque[int] = field(default_factory=deque)
    dim: int = 0
    base: int = 0
    n: int = 0
    finished: bool = False  # the producer is done
    producer_item: int | None = None  # a loop item its runner steps (``fast``): gets credit
    closed: bool = False  # the consumer is done: later items are dropped

    @property
    def buffered(self) -> int:
        return self.n - self.base

    def append(self, piece: Any) -> None:
        if self.closed:
            return
        if not isinstance(piece, torch.Tensor):
            raise LoopError(
                f"stream {self.spec.edge.name!r} carries {type(piece).__name__}, not a tensor"
            )
        acc = self.spec.acc
        if acc is not None and acc.mode == "stack":
            piece = piece.unsqueeze(acc.dim if acc.dim >= 0 else acc.dim + piece.dim() + 1)
        self._add(piece)

    def _add(self, piece: torch.Tensor) -> None:
        """Buffer ``piece``, laid out as its source accumulates it (a stacked one with its
        stacking dim): its items along the chunk dim."""
        acc = self.spec.acc
        dim = self.spec.edge.dim if self.spec.edge.dim >= 0 else self.spec.edge.dim + piece.dim()
        if acc is not None:
            acc_dim = acc.dim if acc.dim >= 0 else acc.dim + piece.dim()
            if acc_dim != dim:
                raise LoopError(
                    f"stream {self.spec.edge.name!r} chunks along dim {dim}, but its source "
                    f"accumulates along dim {acc_dim}; streaming needs the same dim"
                )
        self.dim = dim
        self.pieces.append(piece)
        self.sizes.append(int(piece.shape[dim]))
        self.n += int(piece.shape[dim])

    def extend(self, pieces: Sequence[Any]) -> None:
        """``append`` of each of ``pieces`` in order (a producer's items a rank held: several
        steps'), the layout checks made once where they all have the first's number of dims;
        a ``StepBlock`` among them (``stepvalues.segments``) is buffered as one piece, joined
        as its source joins the steps' pieces (one view, not a piece per step)."""
        for part in segments(pieces):
            if isinstance(part, StepBlock):
                self._add_block(part)
            else:
                self._extend(part)

    def _add_block(self, steps: StepBlock) -> None:
        acc, block = self.spec.acc, steps.block
        if self.closed or len(steps) == 0:
            return
        nd = block.dim() - 1  # a piece's dims
        joined = nd + 1 if acc is not None and acc.mode == "stack" else nd
        if acc is None or nd < 1 or not -joined <= acc.dim < joined:
            self._extend(list(steps))  # no join to follow: step by step, each checked
            return
        if acc.mode == "stack":  # the steps at the stacking dim
            self._add(block.movedim(0, acc.dim % (nd + 1)))
            return
        d = acc.dim % nd  # cat: [steps, .., n at d, ..] -> [.., steps * n at d, ..]
        self._add(block.movedim(0, d).flatten(d, d + 1))

    def _extend(self, pieces: Sequence[Any]) -> None:
        if not pieces:
            return
        first = pieces[0]
        self.append(first)
        rest = pieces[1:]
        if self.closed or not rest:
            return
        if not all(isinstance(p, torch.Tensor) and p.dim() == first.dim() for p in rest):
            for piece in rest:
                self.append(piece)  # each checked (and the first that is wrong said)
            return
        acc = self.spec.acc
        if acc is not None and acc.mode == "stack":
            rest = [p.unsqueeze(acc.dim if acc.dim >= 0 else acc.dim + p.dim() + 1) for p in rest]
        sizes = [int(p.shape[self.dim]) for p in rest]
        self.pieces.extend(rest)
        self.sizes.extend(sizes)
        self.n += sum(sizes)

    def ready(self) -> int:
        return self.spec.policy.ready(self.n, self.finished)

    def chunk(self, i: int) -> tuple[torch.Tensor, ChunkSpan]:
        """Chunk ``i`` cut from the retained pieces (``ready() > i``)."""
        span = self.spec.policy.span(i, self.n, self.finished)
        first = -1  # the first piece the chunk reads
        parts: list[torch.Tensor] = []
        offset = pos = self.base
        for k, (piece, size) in enumerate(zip(self.pieces, self.sizes)):
            if pos + size <= span.start:
                offset = pos + size
            elif pos < span.stop:
                first = k if first < 0 else first
                parts.append(piece)
            pos += size
        if span.start < self.base or not parts:
            raise LoopError(f"stream {self.spec.edge.name!r} released chunk {i}'s items")
        if len(parts) == 1:
            x = parts[0]
        else:
            x = self._join(first, parts)
        return take(x, span, self.dim, self.spec.policy.pad_value, offset), span

    def _join(self, first: int, parts: list[torch.Tensor]) -> torch.Tensor:
        """The pieces from ``first`` on as one tensor, which replaces them (the chunks after
        this one, which overlap it or lie in the pieces already here, are cut out of it
        instead of joining single items again: a token stream's windows); where the later
        pieces do not join, the chunk's ``parts`` alone."""
        pieces = list(self.pieces)
        try:
            x = torch.cat(pieces[first:], dim=self.dim)
            end = len(pieces)
        except RuntimeError:  # a later piece of another shape: said when a chunk reads it
            x = torch.cat(parts, dim=self.dim)
            end = first + len(parts)
        sizes = list(self.sizes)
        self.pieces = deque([*pieces[:first], x, *pieces[end:]])
        self.sizes = deque([*sizes[:first], sum(sizes[first:end]), *sizes[end:]])
        return x

    def release(self, before: int) -> None:
        """Drop items ``< before``. A piece cut in two keeps a view of its tail until the
        memory under that view is more than twice the tail's; then it keeps a copy of the
        tail. So a stream holds at most about twice the bytes of its live items, and a window
        sliding over one long piece (a token stream's pieces, joined once by ``_join``) copies
        the tail once per halving, not once per window (quadratic in the piece's length)."""
        while self.pieces and self.base + self.sizes[0] <= before:
            self.base += self.sizes.popleft()
            self.pieces.popleft()
        if self.pieces and self.base < before:
            cut = before - self.base
            rest = self.sizes[0] - cut
            tail = self.pieces[0].narrow(self.dim, cut, rest)
            if tail.untyped_storage().nbytes() > 2 * tail.numel() * tail.element_size():
                tail = tail.clone()
            self.pieces[0] = tail
            self.sizes[0] = rest
            self.base = before


@dataclass(eq=False)
class Forward:
    """A stream between two regions of one frame: the producer's committed pieces wait
    here until the consumer region is dispatched, then go to it as ``Feed``; those sent stay
    referenced until the consumer says it received them (they live on the producer's rank)."""

    stream: str
    channel: str
    pending: list[Any] = field(default_factory=list)
    sent: deque[Any] = field(default_factory=deque)
    received: int = 0  # pieces the consumer has (in ``sent`` order)
    producer: int | None = None  # region items
    consumer: int | None = None
    finished: bool = False
    finish_sent: bool = False
    credit: int | None = None  # the consumer's base + the limit, when it said


@dataclass(eq=False)
class Frame:
    """One instance of a block: a walk body, or one iteration of a loop body."""

    spec: BlockSpec
    path: tuple[int, ...]
    parent: Frame | None
    env: dict[str, Any] = field(default_factory=dict)
    uses: dict[str, int] = field(default_factory=dict)
    todo: dict[str, list[int]] = field(default_factory=dict)  # node -> undispatched op indices
    regions: list[RegionSpec] = field(default_factory=list)  # regions not dispatched
    waiting: list[LoopSpec] = field(default_factory=list)  # loops not started
    runs: list[LoopRun] = field(default_factory=list)  # loops started, not finished
    streams: dict[str, Stream] = field(default_factory=dict)
    forwards: dict[str, Forward] = field(default_factory=dict)  # streams between regions
    inflight: set[int] = field(default_factory=set)
    speculative: bool = False
    alive: bool = True
    dispatched: int = 0
    error: str | None = None
    quiet: bool = False  # nothing to pump until its items end (a flat loop's iteration)

    def done(self) -> bool:
        return not (
            self.inflight
            or self.waiting
            or self.runs
            or self.regions
            or self.error
            or any(self.todo.values())
        )

    def in_speculation(self) -> bool:
        f: Frame | None = self
        while f is not None:
            if f.speculative:
                return True
            f = f.parent
        return False


@dataclass(eq=False)
class LoopRun:
    """One execution of a loop inside ``parent``. Iterations ``< committed`` are done;
    ``frames`` holds the live ones (at most ``LoopSpec.ahead``); stops are known false below
    ``known``."""

    spec: LoopSpec
    parent: Frame
    carried: dict[str, Any]  # carried values for the next iteration to start, by param
    fixed: dict[str, Any]
    bound: int | None  # None: a stream's chunk count, not known until the producer ends
    cap: int | None  # max_iters of a stream loop
    frames: dict[int, Frame] = field(default_factory=dict)
    started: int = 0
    committed: int = 0
    known: int = 0
    stop_at: int | None = None  # iteration count once a stop came true
    collected: dict[str, list[Any]] = field(default_factory=dict)
    last: list[Any] | None = None  # body outputs of the last committed iteration
    flying: int = 0  # iterations out in map items (no frame of their own)
    results: dict[int, list[Any]] = field(default_factory=dict)  # theirs, until committed


@dataclass(eq=False)
class RequestState:
    id: str
    walk: str
    state: dict[str, Any]
    root: Frame
    walk_inputs: dict[str, Any]
    transitions: int = 0
    sent: set[str] = field(default_factory=set)  # outputs of this walk sent before its end
    # the client reads stream items: all (True), none (False: only the final outputs), or
    # those of these walk outputs (a region walk's streams to other ranks)
    stream: bool | frozenset[str] = True

    def streams(self, output: str) -> bool:
        return self.stream is True or (self.stream is not False and output in self.stream)


@dataclass(eq=False)
class Pending:
    request: RequestState
    frame: Frame
    node: str
    ops: tuple[str, ...]
    internal: dict[str, int]  # reads of values produced inside the item
    item: WorkItem  # as issued: ``defer`` issues it again
    region: RegionSpec | None = None
    delivered: set[str] = field(default_factory=set)  # outputs bound (``partial``)
    window: tuple[LoopRun, int] | None = None  # a map item's: its run, its first iteration


class RequestFailed(Exception):
    pass


def piece_items(piece: Any, acc: ir.Accumulated) -> int:
    """Stream items one committed piece adds (cat: its length along the dim; stack: one)."""
    if acc.mode == "stack" or not isinstance(piece, torch.Tensor):
        return 1
    shape = piece.shape
    return int(shape[acc.dim if acc.dim >= 0 else acc.dim + len(shape)])


def first_error(f: Frame) -> str | None:
    """The first deferred error of ``f`` or a frame under it that is not speculative."""
    if f.error is not None:
        return f.error
    for run in f.runs:
        for sub in run.frames.values():
            error = None if sub.speculative else first_error(sub)
            if error is not None:
                return error
    return None


def frame_streams(f: Frame) -> list[Stream]:
    out = list(f.streams.values())
    for run in f.runs:
        for sub in run.frames.values():
            out += frame_streams(sub)
    return out


def count_values(req: RequestState) -> int:
    def frame(f: Frame) -> int:
        n = len(f.env) + sum(len(s.pieces) for s in f.streams.values())
        for run in f.runs:
            n += len(run.carried) + len(run.fixed) + len(run.last or ())
            n += sum(len(v) for v in run.collected.values())
            n += sum(len(v) for v in run.results.values())
            n += sum(frame(sub) for sub in run.frames.values())
        return n

    return len(req.state) + frame(req.root) if req.root.alive else len(req.state)
