"""Paged attention: the backend contract, its per-step metadata, the PyTorch reference backend and
the double-buffered planner.

Owns the index math that turns a batch of sequences (block table, tokens already cached, new query
tokens) into what a paged attention kernel reads, and the attention over the paged KV pool. The
pool (``pool.py``) owns pages and their allocation; this module only reads the pages it is told
about. What crosses the boundary:

- in, from the scheduler: one ``SequenceSpec`` per sequence of the step, and an
  ``AttentionConfig`` per layer kind (heads, head size, page size, window, scale);
- out, to the model runner: ``AttentionMetadata``, built by ``backend.plan(...)`` *before* the
  step (so planning step N+1 overlaps step N, see ``DoubleBufferedPlanner``);
- per layer: ``write_kv`` puts the step's new K/V at ``metadata.slot_mapping``, then
  ``backend.run(q, k_cache, v_cache, metadata)`` returns the attention output.

KV pool, one layer (``k_cache`` and ``v_cache`` alike: ``[num_pages, page_size, kv_heads,
head_dim]``), page_size = 4::

    page id          0            1            2            3            4
                +------------+------------+------------+------------+------------+
    k_cache     | .  .  .  . | a4 a5 a6 . | b0 b1 b2 b3| a0 a1 a2 a3| b4 .  .  . |
                +------------+------------+------------+------------+------------+
    flat slot     0  ..   3    4  ..   7    8  ..  11   12  ..  15   16  ..  19

    sequence a: block table [3, 1], 7 tokens.  Position p lives in page table[p // page_size]
                at offset p % page_size:  slot = table[p // page_size] * page_size + p % page_size
                (a5 -> 1 * 4 + 1 = 5).  The last page is partially filled.
    sequence b: block table [2, 4], 5 tokens.

Packed queries (``q: [total_query_tokens, num_heads, head_dim]``, sequences back to back)::

    q rows        | a: 3 new tokens  | b: 1 | c: 5 new tokens          |
    query_start   [0,                 3,     4,                         9]
    query_len     [3, 1, 5]     context_len [4, 4, 0]     (a: chunked prefill, b: decode,
                                                            c: prefill)

``context_len`` counts the tokens in the cache *before* this step. The caller writes the queries'
own K/V first, so the query at position ``p = context_len + i`` attends to positions ``[0, p]``,
or with a sliding window ``W`` to ``(p - W, p]``. Mask of sequence a with ``W = 3`` (``x``:
attended)::

    key position j    0  1  2  3  4  5  6
    query p = 4       .  .  x  x  x  .  .
    query p = 5       .  .  .  x  x  x  .
    query p = 6       .  .  .  .  x  x  x

Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F

NUM_PLAN_SLOTS = 2
"""Metadata buffers per backend: the one the running step reads and the one being planned."""

P = TypeVar("P")

SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""``scaled_dot_product_attention(..., enable_gqa=True)`` exists (torch >= 2.5)."""


@dataclass(frozen=True)
class AttentionConfig:
    """What is fixed for a layer kind: shapes, page size, window and softmax scale.

    ``sliding_window``: a query at position p attends to ``(p - W, p]``; None: no window.
    ``scale``: softmax scale; None means ``1 / sqrt(head_dim)``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sliding_window: int | None = None
    scale: float | None = None

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

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a step, as the scheduler sees it.

    ``block_table``: its pages in order; entries past ``ceil(seq_len / page_size)`` (pages
    reserved ahead) are ignored. ``context_len``: tokens already cached before this step.
    ``query_len``: new tokens this step (1 for decode), whose K/V the caller writes before
    attention runs.
    """

    block_table: tuple[int, ...]
    context_len: int
    query_len: int

    def __post_init__(self) -> None:
        if self.context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {self.context_len}")
        if self.query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {self.query_len}")
        if any(page < 0 for page in self.block_table):
            raise ValueError(f"page ids must be >= 0, got {self.block_table}")

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(frozen=True, eq=False)
class AttentionMetadata(Generic[P]):
    """Everything attention needs for one step, built by ``plan`` before the step.

    Tensors live on the backend's device and are never written after ``plan`` returns.
    ``block_tables`` row i is valid in ``[:num_pages[i]]`` and zero after it. ``prepared`` is
    the backend's own plan (gather indices and masks for ``TorchPagedAttention``, a planned
    wrapper for FlashInfer); ``slot`` is the planner buffer it was built into.
    """

    config: AttentionConfig
    slot: int
    query_start: torch.Tensor  # [batch + 1] int32
    query_len: torch.Tensor  # [batch] int32
    context_len: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_pages] int32
    num_pages: torch.Tensor  # [batch] int32
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
        v_cache: torch.Tensor,
        metadata: AttentionMetadata[P],
    ) -> torch.Tensor: ...  # [total_query_tokens, num_heads, head_dim]


@dataclass(frozen=True, eq=False)
class HostLayout:
    """The batch's index tensors on the host (int32), shared by every backend's ``plan``."""

    query_start: torch.Tensor  # [batch + 1]
    query_len: torch.Tensor  # [batch]
    context_len: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, max_pages], zero-padded
    num_pages: torch.Tensor  # [batch]
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
            slot_mapping=self.slot_mapping.to(device),
            total_query_tokens=self.total_query_tokens,
            max_page_id=self.max_page_id,
            prepared=prepared,
        )


def pages_needed(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def sequence_slots(spec: SequenceSpec, page_size: int) -> torch.Tensor:
    """Flat slots of positions ``[0, seq_len)``: ``table[p // page_size] * page_size + p %
    page_size``, as int64 ``[seq_len]``."""
    pos = torch.arange(spec.seq_len, dtype=torch.int64)
    table = torch.tensor(spec.block_table[: pages_needed(spec.seq_len, page_size)])
    return table.to(torch.int64)[pos // page_size] * page_size + pos % page_size


def host_layout(batch: Sequence[SequenceSpec], config: AttentionConfig) -> HostLayout:
    """Validate a batch and lay out its index tensors (see the module docstring)."""
    if not batch:
        raise ValueError("an attention batch needs at least one sequence")
    page_size = config.page_size
    num_pages = [pages_needed(s.seq_len, page_size) for s in batch]
    for i, (spec, n) in enumerate(zip(batch, num_pages)):
        if len(spec.block_table) < n:
            raise ValueError(
                f"sequence {i}: {spec.seq_len} tokens need {n} pages of {page_size}, "
                f"but its block table has {len(spec.block_table)}"
            )
    tables = torch.zeros(len(batch), max(num_pages), dtype=torch.int32)
    for i, (spec, n) in enumerate(zip(batch, num_pages)):
        tables[i, :n] = torch.tensor(spec.block_table[:n], dtype=torch.int32)
    query_len = torch.tensor([s.query_len for s in batch], dtype=torch.int32)
    query_start = torch.zeros(len(batch) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(query_len, 0)
    slot_mapping = torch.cat(
        [sequence_slots(s, page_size)[s.context_len :] for s in batch]
    )  # [total_query_tokens]
    return HostLayout(
        query_start=query_start,
        query_len=query_len,
        context_len=torch.tensor([s.context_len for s in batch], dtype=torch.int32),
        block_tables=tables,
        num_pages=torch.tensor(num_pages, dtype=torch.int32),
        slot_mapping=slot_mapping,
        max_page_id=max(max(s.block_table[:n]) for s, n in zip(batch, num_pages)),
    )


def write_kv(
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64, slot = page * page_size + offset
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
) -> None:
    """Write new tokens' K/V into the pool at their flat slots (in place)."""
    if k_cache.shape != v_cache.shape or k.shape != v.shape:
        raise ValueError(f"k/v shapes differ: {k_cache.shape} {v_cache.shape} {k.shape} {v.shape}")
    if k.shape[1:] != k_cache.shape[2:] or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)} with "
            f"{slot_mapping.shape[0]} slots"
        )
    _flat(k_cache).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    _flat(v_cache).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_size, H, D]`` -> ``[num_pages * page_size, H, D]`` (a view)."""
    if not cache.is_contiguous():
        raise ValueError("KV cache tensors must be contiguous")
    return cache.view(-1, cache.shape[2], cache.shape[3])


def check_run_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata[P]
) -> None:
    """Shape, dtype and page-range checks shared by backends (host values only, no sync)."""
    c = metadata.config
    want_q = (metadata.total_query_tokens, c.num_heads, c.head_dim)
    if tuple(q.shape) != want_q:
        raise ValueError(f"q has shape {tuple(q.shape)}, this plan needs {want_q}")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[1:]) != (
        c.page_size,
        c.num_kv_heads,
        c.head_dim,
    ):
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match "
            f"[num_pages, {c.page_size}, {c.num_kv_heads}, {c.head_dim}]"
        )
    if metadata.max_page_id >= k_cache.shape[0]:
        raise ValueError(
            f"the plan reads page {metadata.max_page_id}, the pool has {k_cache.shape[0]} pages"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")


# --- the PyTorch reference backend -----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DecodeGroup:
    """All single-query sequences, attended in one padded SDPA call."""

    rows: torch.Tensor  # [n] int64: their rows of q
    pages: torch.Tensor  # [n, max_pages] int64, padded with the sequence's first page
    mask: torch.Tensor  # [n, 1, 1, max_pages * page_size] bool, True = attend


@dataclass(frozen=True, eq=False)
class PrefillPiece:
    """One multi-query sequence (prefill or chunked prefill), attended on its own."""

    q_start: int
    q_end: int
    pages: torch.Tensor  # [pages_needed(seq_len)] int64
    seq_len: int
    mask: torch.Tensor  # [query_len, seq_len] bool, True = attend


@dataclass(frozen=True, eq=False)
class TorchPlan:
    decode: DecodeGroup | None
    prefills: tuple[PrefillPiece, ...]


def attend_mask(context_len: int, query_len: int, window: int | None) -> torch.Tensor:
    """``[query_len, seq_len]`` bool: query at ``p = context_len + i`` sees key ``j`` iff
    ``j <= p`` and (no window or ``j > p - window``)."""
    p = torch.arange(context_len, context_len + query_len).unsqueeze(1)  # [L, 1]
    j = torch.arange(context_len + query_len).unsqueeze(0)  # [1, S]
    mask = j <= p
    if window is not None:
        mask &= j > p - window
    return mask


class TorchPagedAttention:
    """Paged attention in plain PyTorch: gathers each sequence's pages into contiguous K/V and
    calls ``scaled_dot_product_attention`` with an explicit mask. Runs on CPU and CUDA; it is
    the twin that accelerated backends are tested against.

    Plan: single-query sequences (decode) form one group, padded to the group's longest
    sequence (in whole pages) and masked; every multi-query sequence is one piece with its own
    causal/window mask. K/V are gathered by whole pages (one contiguous block per page, several
    times faster on CPU than gathering token slots; the slots past a sequence's end that this
    reads are masked, and hold zeros or the sequence's own stale values, never another
    request's: ``KVPool`` zeroes every page it hands out). All gather indices and masks are built in
    ``plan``; ``run`` only gathers and attends.
    Stateless between steps, so any number of plans may be live at once.
    """

    def __init__(self, config: AttentionConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)

    def plan(self, batch: Sequence[SequenceSpec], slot: int = 0) -> AttentionMetadata[TorchPlan]:
        layout = host_layout(batch, self.config)
        window, page_size, dev = self.config.sliding_window, self.config.page_size, self.device
        starts = layout.query_start.tolist()
        decode_ids = [i for i, s in enumerate(batch) if s.query_len == 1]
        decode: DecodeGroup | None = None
        if decode_ids:
            max_pages = max(pages_needed(batch[i].seq_len, page_size) for i in decode_ids)
            pages = torch.empty(len(decode_ids), max_pages, dtype=torch.int64)
            mask = torch.zeros(len(decode_ids), 1, 1, max_pages * page_size, dtype=torch.bool)
            for row, i in enumerate(decode_ids):
                spec = batch[i]
                own = spec.block_table[: pages_needed(spec.seq_len, page_size)]
                pages[row] = own[0]  # padding reads a valid page; the mask hides it
                pages[row, : len(own)] = torch.tensor(own, dtype=torch.int64)
                mask[row, 0, 0, : spec.seq_len] = attend_mask(spec.context_len, 1, window)[0]
            decode = DecodeGroup(
                rows=torch.tensor([starts[i] for i in decode_ids], device=dev),
                pages=pages.to(dev),
                mask=mask.to(dev),
            )
        prefills = tuple(
            PrefillPiece(
                q_start=starts[i],
                q_end=starts[i + 1],
                pages=torch.tensor(
                    s.block_table[: pages_needed(s.seq_len, page_size)], dtype=torch.int64
                ).to(dev),
                seq_len=s.seq_len,
                mask=attend_mask(s.context_len, s.query_len, window).to(dev),
            )
            for i, s in enumerate(batch)
            if s.query_len > 1
        )
        return layout.to_metadata(self.config, slot, dev, TorchPlan(decode, prefills))

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata[TorchPlan],
    ) -> torch.Tensor:
        check_run_inputs(q, k_cache, v_cache, metadata)
        plan = metadata.prepared
        kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q)  # [T, H, D]
        if plan.decode is not None:
            d = plan.decode
            n = d.pages.shape[0]
            qd = q[d.rows].unsqueeze(2)  # [n, H, 1, D]
            index = d.pages.view(-1)
            kd = k_cache.index_select(0, index).view(n, -1, kv_heads, dim)  # [n, pages * S, ..]
            vd = v_cache.index_select(0, index).view(n, -1, kv_heads, dim)
            o = self._attend(qd, kd, vd, d.mask)
            out[d.rows] = o.squeeze(2)
        for piece in plan.prefills:
            qp = q[piece.q_start : piece.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            kp = k_cache.index_select(0, piece.pages).view(1, -1, kv_heads, dim)[:, : piece.seq_len]
            vp = v_cache.index_select(0, piece.pages).view(1, -1, kv_heads, dim)[:, : piece.seq_len]
            o = self._attend(qp, kp, vp, piece.mask)  # [1, H, L, D]
            out[piece.q_start : piece.q_end] = o[0].transpose(0, 1)
        return out

    def _attend(
        self,
        q: torch.Tensor,  # [N, H, L, D]
        k: torch.Tensor,  # [N, S, kv_heads, D]
        v: torch.Tensor,
        mask: torch.Tensor,  # broadcastable to [N, 1, L, S], True = attend
    ) -> torch.Tensor:  # [N, H, L, D]
        k = k.transpose(1, 2)  # [N, kv_heads, S, D], a view of the gathered copy
        v = v.transpose(1, 2)
        scale = self.config.softmax_scale
        group = self.config.group_size
        if group == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        n, heads, length, dim = q.shape
        if length == 1:
            # Decode: the `group` query heads of a KV head become `group` query rows of it (a
            # view, no K/V copies; head h reads KV head h // group, as transformers' repeat_kv
            # orders them). Much faster on CPU than enable_gqa with a mask.
            qg = q.reshape(n, heads // group, group, dim)  # [N, kv_heads, group, D]
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
            return out.reshape(n, heads, 1, dim)
        if SDPA_HAS_GQA:  # query head h reads KV head h // group inside the kernel
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        k = k.repeat_interleave(group, dim=1)  # [N, H, S, D]
        v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# --- double-buffered planning ----------------------------------------------------------------


class DoubleBufferedPlanner(Generic[P]):
    """Builds the metadata for step N+1 on a background thread while step N runs: the CPU twin
    of FlashInfer's ``plan``/``run`` split, with two metadata buffers (slots)::

        planner.submit(batch_0)
        meta = planner.take()                  # slot 0, now in use
        loop:
            planner.submit(batch_next)         # planned into slot 1 on the planning thread
            out = model_step(meta)             # ... while step N runs on slot 0
            meta = planner.take()              # slot 1 in use; slot 0 free for N+2

    Invariant: a plan is only ever built into the slot that is *not* in use, and the in-use
    slot changes only in ``take``, which waits for the pending plan. So planning step N+1 never
    writes the buffer (metadata, or backend state such as a FlashInfer wrapper) that step N
    reads. At most one plan is pending; ``submit`` twice without ``take`` is an error. A plan
    that raised re-raises from ``take`` and leaves the in-use slot as it was.
    """

    def __init__(self, backend: AttentionBackend[P]) -> None:
        self.backend = backend
        self._buffers: list[AttentionMetadata[P] | None] = [None] * NUM_PLAN_SLOTS
        self._in_use: int | None = None
        self._pending: tuple[int, Future[AttentionMetadata[P]]] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attention-plan")
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int | None:
        """The slot the current step reads, or None before the first ``take``."""
        return self._in_use

    def buffer(self, slot: int) -> AttentionMetadata[P] | None:
        """The metadata last planned into ``slot``."""
        return self._buffers[slot]

    def submit(self, batch: Sequence[SequenceSpec]) -> None:
        """Start planning the next step into the free slot; returns at once."""
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("a plan is already pending: take() it before submitting")
            slot = 0 if self._in_use is None else (self._in_use + 1) % NUM_PLAN_SLOTS
            specs = tuple(batch)  # the caller may mutate its list after submit returns
            self._pending = (slot, self._executor.submit(self._plan, specs, slot))

    def take(self) -> AttentionMetadata[P]:
        """Wait for the pending plan and make its slot the one in use."""
        with self._lock:
            if self._pending is None:
                raise RuntimeError("no plan pending: submit() a batch first")
            slot, future = self._pending
            self._pending = None
        metadata = future.result()
        self._in_use = slot
        return metadata

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> DoubleBufferedPlanner[P]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, batch: tuple[SequenceSpec, ...], slot: int) -> AttentionMetadata[P]:
        if slot == self._in_use:  # unreachable by construction; guards the invariant
            raise RuntimeError(f"refusing to plan into slot {slot}, which a running step reads")
        metadata = self.backend.plan(batch, slot)
        self._buffers[slot] = metadata
        return metadata
