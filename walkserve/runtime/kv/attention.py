"""Paged attention: the backend contract, its per-step metadata and the index math every backend
shares. The PyTorch reference backend is ``torch_attention.py``, FlashInfer's
``flashinfer_backend.py``, the double-buffered planner ``planner.py``.

Owns the index math that turns a batch of sequences (block table, tokens already cached, new query
tokens) into what a paged attention kernel reads. The pool (``pool.py``) owns pages and their
allocation; this module only reads the pages it is told about. What crosses the boundary:

- in, from the scheduler: one ``SequenceSpec`` per sequence of the step, and an
  ``AttentionConfig`` per layer kind (heads, key and value head sizes, page size, window, scale,
  soft cap);
- out, to the model runner: ``AttentionMetadata``, built by ``backend.plan(...)`` *before* the
  step (so planning step N+1 overlaps step N, see ``planner.DoubleBufferedPlanner``);
- per layer: ``write_kv`` puts the step's new K/V at ``metadata.slot_mapping``, then
  ``backend.run(q, k_cache, v_cache, metadata, scores)`` returns the attention output.
  ``scores`` (``ScoreParams``: softmax scale, logit soft cap, per-head sink logits) is what a
  layer may set per call; None means the config's scale and soft cap, no sinks.

KV pool, one layer (``k_cache``: ``[num_pages, page_size, kv_heads, head_dim]``, ``v_cache`` the
same with ``v_head_dim``), page_size = 4::

    page id          0            1            2            3            4
                +------------+------------+------------+------------+------------+
    k_cache     | .  .  .  . | a4 a5 a6 . | b0 b1 b2 b3| a0 a1 a2 a3| b4 .  .  . |
                +------------+------------+------------+------------+------------+
    flat slot     0  ..   3    4  ..   7    8  ..  11   12  ..  15   16  ..  19

    sequence a: block table [3, 1], 7 tokens.  Position p lives in page table[p // page_size]
                at offset p % page_size:  slot = table[p // page_size] * page_size + p % page_size
                (a5 -> 1 * 4 + 1 = 5).  The last page is partially filled.
    sequence b: block table [2, 4], 5 tokens.

Sliding-window layers free the pages that fell out of every window: such a sequence's block table
starts at logical page ``first_page`` (the pages before it are gone), so position p lives in
``table[p // page_size - first_page]``. A sequence of 11 tokens, window 3, page size 4, whose page
0 (positions 0-3) was freed: ``first_page = 1``, ``block_table = [6, 2]`` (positions 4-7, 8-10).

Packed queries (``q: [total_query_tokens, num_heads, head_dim]``, sequences back to back)::

    q rows        | a: 3 new tokens  | b: 1 | c: 5 new tokens          |
    query_start   [0,                 3,     4,                         9]
    query_len     [3, 1, 5]     context_len [4, 4, 0]     (a: chunked prefill, b: decode,
                                                            c: prefill)

``context_len`` counts the tokens in the cache *before* this step. The caller writes the queries'
own K/V first, so the query at position ``p = context_len + i`` attends to positions ``[0, p]``,
or with a sliding window ``W`` to ``(p - W, p]`` (transformers' ``sliding_window``: W keys, the
query's own included). Mask of sequence a with ``W = 3`` (``x``: attended)::

    key position j    0  1  2  3  4  5  6
    query p = 4       .  .  x  x  x  .  .
    query p = 5       .  .  .  x  x  x  .
    query p = 6       .  .  .  .  x  x  x

Scores, in transformers' order: ``s = q.k * scale``; with a soft cap ``c``: ``s = c * tanh(s /
c)``; masked keys get -inf; with sinks, one extra logit per head joins the softmax and is dropped
after it (``softmax([s, sink])[:-1]``: the probabilities sum to less than one).

Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

NUM_PLAN_SLOTS = 2
"""Metadata buffers per backend: the one the running step reads and the one being planned."""

P = TypeVar("P")


@dataclass(frozen=True)
class AttentionConfig:
    """What is fixed for a layer kind: shapes, page size, window, softmax scale and soft cap.

    ``sliding_window``: a query at position p attends to ``(p - W, p]``; None: no window.
    ``scale``: softmax scale; None means ``1 / sqrt(head_dim)``. ``softcap``: logit soft cap
    (``c * tanh(s / c)``); None: none. ``v_head_dim``: the value head size when it differs from
    the key's (multi-head latent attention); None: ``head_dim``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sliding_window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be > 0 or None, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ValueError(f"v_head_dim must be >= 1 or None, got {self.v_head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim


@dataclass(frozen=True, eq=False)
class ScoreParams:
    """How one call turns ``q.k`` into probabilities: ``scale``, an optional logit ``softcap``,
    and optional ``sinks`` (``[num_heads]``, one extra logit per query head; gpt-oss's
    ``s_aux``)."""

    scale: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads]

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")

    @staticmethod
    def of(config: AttentionConfig) -> ScoreParams:
        return ScoreParams(config.softmax_scale, config.softcap)


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a step, as the scheduler sees it.

    ``block_table``: its pages in order, from logical page ``first_page`` on (the pages before
    it were freed: a sliding window no longer reaches them); entries past
    ``ceil(seq_len / page_size)`` (pages reserved ahead) are ignored. ``context_len``: tokens
    already cached before this step. ``query_len``: new tokens this step (1 for decode), whose
    K/V the caller writes before attention runs.
    """

    block_table: tuple[int, ...]
    context_len: int
    query_len: int
    first_page: int = 0

    def __post_init__(self) -> None:
        if self.context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {self.context_len}")
        if self.query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {self.query_len}")
        if self.first_page < 0:
            raise ValueError(f"first_page must be >= 0, got {self.first_page}")
        if any(page < 0 for page in self.block_table):
            raise ValueError(f"page ids must be >= 0, got {self.block_table}")

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(frozen=True, eq=False)
class AttentionMetadata(Generic[P]):
    """Everything attention needs for one step, built by ``plan`` before the step.

    Tensors live on the backend's device and are never written after ``plan`` returns.
    ``block_tables`` row i holds sequence i's live pages in ``[:num_pages[i]]`` (from logical
    page ``first_page[i]``) and zero after them. ``prepared`` is the backend's own plan (gather
    indices and masks for ``TorchPagedAttention``, a planned wrapper for FlashInfer); ``slot``
    is the planner buffer it was built into.
    """

    config: AttentionConfig
    slot: int
    query_start: torch.Tensor  # [batch + 1] int32
    query_len: torch.Tensor  # [batch] int32
    context_len: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_pages] int32
    num_pages: torch.Tensor  # [batch] int32: live pages
    first_page: torch.Tensor  # [batch] int32
    slot_mapping: torch.Tensor  # [total_query_tokens] int64: where the new K/V go
    total_query_tokens: int
    max_page_id: int
    prepared: P

    @property
    def batch_size(self) -> int:
        return int(self.query_len.shape[0])

    @property
    def sliding_window(self) -> int | None:
        return self.config.sliding_window

    @property
    def scale(self) -> float:
        return self.config.softmax_scale

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads


class AttentionBackend(Protocol[P]):
    """Paged attention over the KV pool layout above. ``plan`` is pure host work, safe to call
    on a planning thread for slot ``s`` while ``run`` executes a plan of the other slot."""

    config: AttentionConfig
    device: torch.device

    def plan(self, batch: Sequence[SequenceSpec], slot: int = 0) -> AttentionMetadata[P]: ...

    def run(
        self,
        q: torch.Tensor,  # [total_query_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, v_head_dim]
        metadata: AttentionMetadata[P],
        scores: ScoreParams | None = None,
    ) -> torch.Tensor: ...  # [total_query_tokens, num_heads, v_head_dim]


@dataclass(frozen=True, eq=False)
class HostLayout:
    """The batch's index tensors on the host (int32), shared by every backend's ``plan``."""

    query_start: torch.Tensor  # [batch + 1]
    query_len: torch.Tensor  # [batch]
    context_len: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, max_pages], zero-padded; live pages only
    num_pages: torch.Tensor  # [batch]: live pages
    first_page: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [total_query_tokens] int64
    max_page_id: int

    @property
    def total_query_tokens(self) -> int:
        return int(self.query_start[-1])

    def to_metadata(
        self, config: AttentionConfig, slot: int, device: torch.device, prepared: P
    ) -> AttentionMetadata[P]:
        return AttentionMetadata(
            config=config,
            slot=slot,
            query_start=self.query_start.to(device),
            query_len=self.query_len.to(device),
            context_len=self.context_len.to(device),
            block_tables=self.block_tables.to(device),
            num_pages=self.num_pages.to(device),
            first_page=self.first_page.to(device),
            slot_mapping=self.slot_mapping.to(device),
            total_query_tokens=self.total_query_tokens,
            max_page_id=self.max_page_id,
            prepared=prepared,
        )


def pages_needed(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def live_pages(spec: SequenceSpec, page_size: int) -> tuple[int, ...]:
    """The pages ``spec`` reads this step: logical pages ``[first_page, ceil(seq_len / S))``."""
    return spec.block_table[: pages_needed(spec.seq_len, page_size) - spec.first_page]


def sequence_slots(spec: SequenceSpec, page_size: int, start: int = 0) -> torch.Tensor:
    """Flat slots of positions ``[start, seq_len)`` (``start >= first_page * page_size``):
    ``table[p // page_size - first_page] * page_size + p % page_size``, as int64."""
    pos = torch.arange(start, spec.seq_len, dtype=torch.int64)
    table = torch.tensor(live_pages(spec, page_size), dtype=torch.int64)
    return table[pos // page_size - spec.first_page] * page_size + pos % page_size


def host_layout(batch: Sequence[SequenceSpec], config: AttentionConfig) -> HostLayout:
    """Validate a batch and lay out its index tensors (see the module docstring)."""
    if not batch:
        raise ValueError("an attention batch needs at least one sequence")
    page_size, window = config.page_size, config.sliding_window
    num_pages = []
    for i, spec in enumerate(batch):
        n = pages_needed(spec.seq_len, page_size) - spec.first_page
        if n < 1 or len(spec.block_table) < n:
            raise ValueError(
                f"sequence {i}: {spec.seq_len} tokens from logical page {spec.first_page} need "
                f"{n} pages of {page_size}, but its block table has {len(spec.block_table)}"
            )
        if spec.first_page:
            # Freed pages must hold nothing a query of this step reads (nor a new token).
            reach = 0 if window is None else spec.context_len - window + 1  # first key read
            if spec.first_page * page_size > max(reach, 0):
                raise ValueError(
                    f"sequence {i}: pages before logical page {spec.first_page} were freed, "
                    f"but a query at position {spec.context_len} still reads them"
                    + ("" if window is None else f" (window {window})")
                )
        num_pages.append(n)
    tables = torch.zeros(len(batch), max(num_pages), dtype=torch.int32)
    for i, (spec, n) in enumerate(zip(batch, num_pages)):
        tables[i, :n] = torch.tensor(spec.block_table[:n], dtype=torch.int32)
    query_len = torch.tensor([s.query_len for s in batch], dtype=torch.int32)
    query_start = torch.zeros(len(batch) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(query_len, 0)
    slot_mapping = torch.cat(
        [sequence_slots(s, page_size, s.context_len) for s in batch]
    )  # [total_query_tokens]
    return HostLayout(
        query_start=query_start,
        query_len=query_len,
        context_len=torch.tensor([s.context_len for s in batch], dtype=torch.int32),
        block_tables=tables,
        num_pages=torch.tensor(num_pages, dtype=torch.int32),
        first_page=torch.tensor([s.first_page for s in batch], dtype=torch.int32),
        slot_mapping=slot_mapping,
        max_page_id=max(max(s.block_table[:n]) for s, n in zip(batch, num_pages)),
    )


def write_kv(
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, v_head_dim]
    slot_mapping: torch.Tensor,  # [tokens] int64, slot = page * page_size + offset
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, kv_heads, v_head_dim]
) -> None:
    """Write new tokens' K/V into the pool at their flat slots (in place)."""
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if new.shape[1:] != cache.shape[2:] or new.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"{name} {tuple(new.shape)} does not fit cache {tuple(cache.shape)} with "
                f"{slot_mapping.shape[0]} slots"
            )
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k/v caches differ: {tuple(k_cache.shape)} {tuple(v_cache.shape)}")
    _flat(k_cache).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    _flat(v_cache).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_size, H, D]`` -> ``[num_pages * page_size, H, D]`` (a view)."""
    if not cache.is_contiguous():
        raise ValueError("KV cache tensors must be contiguous")
    return cache.view(-1, cache.shape[2], cache.shape[3])


def check_run_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata[P],
    scores: ScoreParams | None = None,
) -> None:
    """Shape, dtype and page-range checks shared by backends (host values only, no sync)."""
    c = metadata.config
    want_q = (metadata.total_query_tokens, c.num_heads, c.head_dim)
    if tuple(q.shape) != want_q:
        raise ValueError(f"q has shape {tuple(q.shape)}, this plan needs {want_q}")
    want_k = (c.page_size, c.num_kv_heads, c.head_dim)
    want_v = (c.page_size, c.num_kv_heads, c.value_dim)
    if (
        tuple(k_cache.shape[1:]) != want_k
        or tuple(v_cache.shape[1:]) != want_v
        or k_cache.shape[0] != v_cache.shape[0]
    ):
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match "
            f"[num_pages, {', '.join(map(str, want_k))}] / [num_pages, "
            f"{', '.join(map(str, want_v))}]"
        )
    if metadata.max_page_id >= k_cache.shape[0]:
        raise ValueError(
            f"the plan reads page {metadata.max_page_id}, the pool has {k_cache.shape[0]} pages"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if scores is not None and scores.sinks is not None and scores.sinks.shape != (c.num_heads,):
        raise ValueError(
            f"sinks must be [num_heads] = [{c.num_heads}], got {tuple(scores.sinks.shape)}"
        )
