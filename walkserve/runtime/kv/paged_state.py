"""The paged LM's state (``paged_lm.PagedLM``): its configuration and statistics, a request
row's tokens and pages (``Row``), one call of a batch (``Unit``), the per-process state with its
pool and rows (``PagedState``), and the cache handle a walk carries (``PagedKV``): releasing it
frees the rows' pages, deferred while a forward holds the lock (``DeferredRelease``)."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from walkserve.runtime.kv.hf import PagedCausalLMRunner, pool_for
from walkserve.runtime.kv.hf_attention import ModelAttention
from walkserve.runtime.kv.layer_groups import GroupedKVPool
from walkserve.runtime.kv.pool_types import SeqId
from walkserve.runtime.kv.row_sampling import RowState

__all__ = [
    "DeferredRelease",
    "PagedKV",
    "PagedLMConfig",
    "PagedLMStats",
    "PagedState",
    "Row",
    "Unit",
]


@dataclass(frozen=True)
class PagedLMConfig:
    """``pool_tokens``: KV capacity of the pool in tokens (rounded up to whole pages);
    ``page_size``: tokens per page; ``max_step_tokens``: tokens one forward computes, all
    calls together (chunked prefill: a call with more new tokens than fit runs over several
    forwards, see the module docstring; at least a page is computed); None: no limit."""

    pool_tokens: int = 16384
    page_size: int = 16
    max_step_tokens: int | None = 2048

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1 or None, got {self.max_step_tokens}")
        if self.pool_tokens < self.page_size:
            raise ValueError(
                f"pool_tokens must hold at least one page ({self.page_size}), got "
                f"{self.pool_tokens}"
            )

    @property
    def num_pages(self) -> int:
        return -(-self.pool_tokens // self.page_size)


@dataclass(frozen=True)
class PagedLMStats:
    pages_in_use: int
    pages_cached: int
    num_pages: int
    live_sequences: int
    evictions: int  # sequences evicted to make room (recomputed when used again)
    prefix_hits: int
    forwards: int
    tokens_forwarded: int


@dataclass
class Row:
    """One sequence: a batch row of one request's cache."""

    seq: SeqId
    tokens: list[int] = field(default_factory=list)  # every token fed so far
    computed: int = 0  # leading tokens whose K/V are in the pool
    resident: bool = False  # holds pages
    last_used: int = 0
    admitted: int = 0  # clock when it last got pages
    arrived: int = 0  # clock when its request first came
    sampling: RowState = field(default_factory=RowState)  # prompt length, bias, grammar
    extra: Any = None  # what a subclass keeps per row (a VLM's image features and positions)


@dataclass
class Unit:
    """One call of a batch: its rows run together or not at all."""

    index: int  # in the batch
    args: dict[str, Any]
    cache: PagedKV
    rows: list[Row]
    want: list[list[int]]  # per row: every token once this call ran

    @property
    def resident(self) -> bool:
        return all(r.resident for r in self.rows)

    @property
    def admitted(self) -> int:
        return max(r.admitted for r in self.rows)

    @property
    def arrived(self) -> int:
        return min(r.arrived for r in self.rows)


class DeferredRelease:
    """A pool's lock and the releases of dropped caches: ``release`` frees now when the pool is
    idle, else queues for ``drain`` at the next forward; never blocks (a finalizer may run on
    any thread). Subclasses say how to free (``_free``, lock held)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: deque[list[SeqId]] = deque()  # releases that found the lock taken

    def release(self, seqs: list[SeqId]) -> None:
        """Free ``seqs`` (a dropped ``PagedKV``): now if the pool is idle, else at the next
        forward. Never blocks: a finalizer may run on any thread."""
        if self.lock.acquire(blocking=False):
            try:
                self._free(seqs)
                self.drain()
            finally:
                self.lock.release()
        else:
            self.pending.append(seqs)

    def drain(self) -> None:  # lock held
        while self.pending:
            self._free(self.pending.popleft())

    def _free(self, seqs: list[SeqId]) -> None:  # lock held
        raise NotImplementedError


class PagedState(DeferredRelease):
    """The pool and the live sequences of one ``PagedLM`` in one process."""

    def __init__(
        self, model: nn.Module, config: PagedLMConfig, attention: ModelAttention | None
    ) -> None:
        super().__init__()
        self.pool: GroupedKVPool = pool_for(
            model, config.num_pages, config.page_size, attention=attention
        )
        self.runner = PagedCausalLMRunner(model, self.pool)
        self.rows: dict[SeqId, Row] = {}
        self.clock = itertools.count(1)
        self.evictions = 0
        self.forwards = 0
        self.tokens = 0

    def _free(self, seqs: list[SeqId]) -> None:  # lock held
        for seq in seqs:
            row = self.rows.pop(seq, None)
            if row is not None and row.resident:
                self.pool.free(seq)


class PagedKV:
    """A request's K/V in a ``PagedLM``'s pool (one sequence per batch row). Opaque to walks:
    pass it back to the same component. Its pages are freed when it is garbage collected."""

    _ids = itertools.count()

    def __init__(self, state: PagedState, rows: int) -> None:
        request = f"kv{next(PagedKV._ids)}"
        seqs = [SeqId(request, str(r)) for r in range(rows)]
        self._state = weakref.ref(state)
        self.seqs = seqs
        arrived = next(state.clock)
        for seq in seqs:
            state.rows[seq] = Row(seq, arrived=arrived)
        weakref.finalize(self, state.release, seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def __repr__(self) -> str:
        return f"PagedKV({self.seqs[0].request_id}, rows={len(self.seqs)})"
