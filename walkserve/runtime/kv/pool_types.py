"""What crosses the paged KV pool's boundary, as plain values: sequence ids (``SeqId``), token
slots (``Slot``), block-table snapshots (``BlockTable``), the pool's shape (``KVPoolConfig``), its
accounting (``PoolStats``) and its typed errors (``PoolExhausted``, ``UnknownSequence``,
``SequenceExists``). The pool (``pool.py``) makes and raises them; engines, schedulers, adapters
and ``layer_groups.GroupedKVPool`` name sequences and catch the errors through this module. It
imports nothing of the pool, so a caller that only names a sequence need not import the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = [
    "BlockTable",
    "KVError",
    "KVPoolConfig",
    "Positions",
    "PoolExhausted",
    "PoolStats",
    "SeqId",
    "SequenceExists",
    "Slot",
    "TokenIds",
    "UnknownSequence",
]

TokenIds = Sequence[int] | torch.Tensor
Positions = Sequence[int] | torch.Tensor


# ------------------------------------------------------------------------------ errors


class KVError(Exception):
    """Base class of KV pool errors."""


class PoolExhausted(KVError):
    """``needed`` pages were asked for; only ``free`` (free + evictable) could be had. Raised
    before any state changed: the caller may free or preempt something and retry."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: {needed} pages needed, {free} obtainable")
        self.needed = needed
        self.free = free


class UnknownSequence(KVError, KeyError):
    """The sequence has no block table in this pool."""


class SequenceExists(KVError, ValueError):
    """A sequence with this id already has a block table."""


# ------------------------------------------------------------------------------ values


class SeqId(NamedTuple):
    """One cache identity: a request and one of its labelled contexts."""

    request_id: str
    label: str


class Slot(NamedTuple):
    """Where one token's K/V lives in every layer: ``pool.k[layer, page, offset]``."""

    page: int
    offset: int

    def flat(self, page_size: int) -> int:
        """Index into ``pool.k[layer].view(-1, kv_heads, head_dim)``."""
        return self.page * page_size + self.offset


@dataclass(frozen=True)
class BlockTable:
    """A snapshot of one sequence's live pages; token t is at ``pages[t // page_size -
    first_page]`` (``first_page`` > 0 once leading pages were released)."""

    pages: tuple[int, ...]
    num_tokens: int
    first_page: int = 0


@dataclass(frozen=True)
class KVPoolConfig:
    """Shape and placement of a pool. ``nbytes`` can be computed before allocating."""

    num_pages: int
    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    v_head_dim: int | None = None  # None: head_dim

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVPoolConfig.{name} must be a positive int, got {value!r}")
        v = self.v_head_dim
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"KVPoolConfig.v_head_dim must be a positive int or None, got {v!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVPoolConfig.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, num_pages, page_size, kv_heads, head_dim]``, of K."""
        return (self.num_layers, self.num_pages, self.page_size, self.kv_heads, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, num_pages, page_size, kv_heads, v_head_dim]``, of V."""
        return (self.num_layers, self.num_pages, self.page_size, self.kv_heads, self.value_dim)

    @property
    def bytes_per_page(self) -> int:
        """K and V of one page, all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        dims = self.head_dim + self.value_dim
        return self.num_layers * self.page_size * self.kv_heads * dims * itemsize

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page


@dataclass(frozen=True)
class PoolStats:
    """Exact accounting at one moment; counters since the pool was made."""

    num_pages: int
    page_size: int
    pages_in_use: int
    pages_free: int
    pages_cached: int  # referenced by nobody, kept for prefix hits, evictable
    sequences: int
    requests: int
    tokens: int
    prefix_hits: int  # full pages reused
    prefix_misses: int  # full pages looked up and not found
    evictions: int
    cow_copies: int
    nbytes: int
