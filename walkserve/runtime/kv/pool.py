"""The paged KV pool: block tables of sequences over one preallocated set of K/V pages.

Owns one block table per sequence, copy-on-write, and, through ``PrefixCache`` (``prefix.py``),
the reuse of full pages across requests. Page reference counts and the free list are its
``PageAllocator``'s (``pages.py``); the K and V tensors, their layout and the index math into
them are its ``PageTensors``' (``page_tensors.py``). It does no attention math and knows no model.

What crosses its boundary:

- in: ``SeqId(request_id, label)`` and token counts (or token ids, for prefix caching);
- out: ``Slot(page, offset)`` lists telling an engine where to write new tokens' K/V,
  ``BlockTable`` snapshots telling an attention kernel where to read, ``PoolStats``, and the
  typed errors ``PoolExhausted``, ``UnknownSequence``, ``SequenceExists`` (all of them values
  defined in ``pool_types.py``);
- tensors only through ``write``/``gather`` (tests and the CPU attention reference); engines
  index ``pool.k``/``pool.v`` with slots themselves.

Token t of a sequence is at ``Slot(pages[t // page_size], t % page_size)`` of its block table
(``page_tensors.py`` draws the layout). A page id means the same slots in every layer, so one
block table serves all layers. Layers whose pages live differently (sliding-window layers next
to full ones) get pools of their own (``layer_groups.GroupedKVPool``).

Freeing leading pages (sliding windows): ``release_leading(seq, n)`` drops a sequence's first
``n`` logical pages, which no query will read again; its block table then starts at logical page
``first_page`` (``BlockTable.pages`` holds the live pages only), and positions before
``first_page * page_size`` can no longer be written or read.

Sequences and labels: a sequence is ``(request_id, label)``. The label is an extra cache
identity over the same pool ("cond", "uncond", "image" contexts of one guided walk), so each
labelled context gets paging, forking and prefix reuse instead of a dense per-context cache.
``free_request``/``preempt`` act on all labels of a request.

Pages are free, in use (named by block-table entries) or cached and evictable; ``pages.py``
draws their lifecycle. ``pages_in_use + pages_free + pages_cached == num_pages``, always.

Copy-on-write: ``fork`` shares every page (ref + 1). A page is written in place only while its
one reference is the writer's and it is not registered in the prefix cache; otherwise the
writer first gets a private copy. ``append`` does this for a shared, partially filled last page
before returning its slots; ``write`` does it for any page it touches. **The pool copies the
page itself** (all layers, K and V); ``copy_on_write`` returns the ``(src, dst)`` pairs it
copied, for logging and tests: the caller has nothing to copy. Slots returned by ``append`` stay
private to the sequence until it is forked again.

Prefix caching: ``allocate_with_prefix`` reuses the longest run of cached full pages whose
chained key matches (see ``prefix.py``); ``mark_computed`` registers a sequence's full pages once
their K/V is written, so no request reads K/V that is not computed yet. A partial last page is
never registered, hence never shared across requests. A registered page holds exactly the K/V
of its key: it is immutable (a write copies it first), and a page whose computed K/V is
rewritten, or that was copied, loses its key and is never registered.

Exhaustion: an operation that needs more pages than are free plus evictable raises
``PoolExhausted(needed, free)`` *before* changing anything. Not thread-safe: one engine thread
owns a pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from walkserve.runtime.kv.page_tensors import PageTensors
from walkserve.runtime.kv.pages import PageAllocator
from walkserve.runtime.kv.pool_types import (
    BlockTable,
    KVPoolConfig,
    PoolStats,
    Positions,
    SeqId,
    SequenceExists,
    Slot,
    TokenIds,
    UnknownSequence,
)
from walkserve.runtime.kv.prefix import PrefixCache, page_keys, root_key

__all__ = ["KVPool"]

FREED = -1
"""A ``_Seq.pages`` entry whose page was released (``release_leading``)."""


@dataclass
class _Seq:
    pages: list[int]  # one entry per logical page; the first ``first`` are FREED
    num_tokens: int
    keys: list[bytes | None]  # prefix key per full prompt page; None once rewritten
    computed: int = 0  # leading tokens whose K/V the caller declared written (mark_computed)
    first: int = 0  # leading logical pages released

    def live(self) -> list[int]:
        return self.pages[self.first :]


# ------------------------------------------------------------------------------ the pool


class KVPool:
    """Paged K/V memory shared by all sequences (requests x labels) of one engine."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ) -> None:
        self.config = KVPoolConfig(
            num_pages,
            page_size,
            num_layers,
            kv_heads,
            head_dim,
            dtype,
            torch.device(device),
            v_head_dim,
        )
        self._tensors = PageTensors(self.config, device)
        self.k = self._tensors.k  # [L, P, S, kv_heads, head_dim]
        self.v = self._tensors.v  # [L, P, S, kv_heads, v_head_dim]
        self._seqs: dict[SeqId, _Seq] = {}
        self._labels: dict[str, list[str]] = {}  # request id -> its labels, in creation order
        self._prefix = PrefixCache()
        self._pages = PageAllocator(num_pages, self._prefix)
        self._cow_copies = 0

    # ---------------------------------------------------------------------- sizes

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    @property
    def nbytes(self) -> int:
        """Bytes of K and V: ``2 * layers * pages * page_size * heads * dim * itemsize``."""
        return self._tensors.nbytes

    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens."""
        return -(-n_tokens // self.page_size)

    # ---------------------------------------------------------------------- accounting

    @property
    def pages_in_use(self) -> int:
        return self._pages.num_in_use

    @property
    def pages_free(self) -> int:
        """Pages holding nothing; evictable cached pages are not counted (``pages_cached``)."""
        return self._pages.num_free

    @property
    def pages_cached(self) -> int:
        """Pages nobody references, kept for prefix hits; reclaimed LRU when needed."""
        return self._pages.num_cached

    @property
    def pages_available(self) -> int:
        """Pages an allocation can get now: free plus evictable."""
        return self._pages.num_available

    def can_allocate(self, n_pages: int) -> bool:
        """Admission check: would ``n_pages`` new pages fit (evicting cached pages if needed)?"""
        return n_pages <= self.pages_available

    def pages_of(self, request_id: str) -> frozenset[int]:
        """The distinct pages the request's sequences reference (all labels)."""
        labels = self._labels.get(request_id, [])
        return frozenset(p for lb in labels for p in self._seqs[SeqId(request_id, lb)].live())

    def ref_count(self, page: int) -> int:
        return self._pages.ref_count(page)

    def is_cached(self, page: int) -> bool:
        """Is ``page`` registered in the prefix cache (referenced or evictable)?"""
        return self._prefix.is_registered(page)

    def evictable_pages(self) -> list[int]:
        """Cached pages nobody references, in eviction order (least recently used first)."""
        return self._prefix.evictable_pages()

    def stats(self) -> PoolStats:
        prefix = self._prefix.stats()
        return PoolStats(
            num_pages=self.num_pages,
            page_size=self.page_size,
            pages_in_use=self.pages_in_use,
            pages_free=self.pages_free,
            pages_cached=self.pages_cached,
            sequences=len(self._seqs),
            requests=len(self._labels),
            tokens=sum(s.num_tokens for s in self._seqs.values()),
            prefix_hits=prefix.hits,
            prefix_misses=prefix.misses,
            evictions=prefix.evictions,
            cow_copies=self._cow_copies,
            nbytes=self.nbytes,
        )

    # ---------------------------------------------------------------------- sequences

    def sequences(self) -> list[SeqId]:
        return list(self._seqs)

    def labels(self, request_id: str) -> list[str]:
        return list(self._labels.get(request_id, []))

    def block_table(self, seq: tuple[str, str]) -> BlockTable:
        s = self._get(seq)
        return BlockTable(tuple(s.live()), s.num_tokens, s.first)

    def num_tokens(self, seq: tuple[str, str]) -> int:
        return self._get(seq).num_tokens

    def allocate(self, seq: tuple[str, str], n_tokens: int) -> None:
        """A new sequence with room for ``n_tokens`` tokens (whole pages)."""
        key = self._check_new(seq)
        _check_count("n_tokens", n_tokens)
        self._add(key, _Seq(self._take(self.pages_for(n_tokens)), n_tokens, []))

    def allocate_with_prefix(
        self,
        seq: tuple[str, str],
        token_ids: TokenIds,
        extra_key: bytes | str | None = None,
        *,
        namespace: str = "",
        max_cached_tokens: int | None = None,
    ) -> int:
        """A new sequence for ``token_ids``, reusing cached full pages of the same prefix.

        ``namespace`` names the model/adapter; ``extra_key`` whatever else the K/V depend on
        (``prefix.features_key(image_features)``). Returns how many leading tokens are cached
        (a multiple of ``page_size``); the caller computes and writes the rest, then calls
        ``mark_computed``. ``max_cached_tokens`` caps reuse, e.g. ``len(token_ids) - 1`` when the
        caller needs the last prompt position's output."""
        key = self._check_new(seq)
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if max_cached_tokens is not None:
            _check_count("max_cached_tokens", max_cached_tokens)
        keys = page_keys(ids, self.page_size, root_key(namespace, extra_key))
        limit = len(keys) if max_cached_tokens is None else max_cached_tokens // self.page_size
        looked_up = keys[:limit]
        hits = self._prefix.lookup(looked_up)
        n_new = self.pages_for(len(ids)) - len(hits)
        reviving = sum(1 for p in hits if self._pages.ref_count(p) == 0)
        self._pages.require(n_new, reviving=reviving)
        for page in hits:  # before taking: a revived page must not be evicted for ourselves
            self._pages.retain(page)
        pages = hits + self._take(n_new)
        self._prefix.record(hits=len(hits), misses=len(looked_up) - len(hits))
        self._add(key, _Seq(pages, len(ids), [*keys]))
        return len(hits) * self.page_size

    def mark_computed(self, seq: tuple[str, str], n_tokens: int | None = None) -> int:
        """Declare that the first ``n_tokens`` (default: all) positions hold, in every layer,
        the K/V the model computes for the tokens given to ``allocate_with_prefix``; register
        the full pages among them that still have prefix keys. Returns how many of those pages
        are now cached (a key already cached under another page keeps that page)."""
        s = self._get(seq)
        n = s.num_tokens if n_tokens is None else n_tokens
        if not 0 <= n <= s.num_tokens:
            raise ValueError(f"n_tokens must be in [0, {s.num_tokens}], got {n}")
        s.computed = max(s.computed, n)
        cached = 0
        for index, key in enumerate(s.keys[: n // self.page_size]):
            page = s.pages[index]
            if key is not None and page != FREED and self._prefix.register(key, page):
                cached += 1
        return cached

    def cached_prefix_tokens(
        self,
        token_ids: TokenIds,
        extra_key: bytes | str | None = None,
        *,
        namespace: str = "",
        max_cached_tokens: int | None = None,
    ) -> int:
        """How many leading tokens ``allocate_with_prefix`` with the same arguments would find
        cached now (a multiple of ``page_size``). Pure: no counters, no LRU change."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        keys = page_keys(ids, self.page_size, root_key(namespace, extra_key))
        limit = len(keys) if max_cached_tokens is None else max_cached_tokens // self.page_size
        return len(self._prefix.lookup(keys[:limit])) * self.page_size

    def release_leading(self, seq: tuple[str, str], n_pages: int) -> int:
        """Release ``seq``'s logical pages before ``n_pages`` (those no query reads again: a
        sliding window moved past them); the last page is always kept. Returns how many pages
        were released now. Registered pages stay cached for prefix hits (evictable)."""
        s = self._get(seq)
        _check_count("n_pages", n_pages)
        stop = min(n_pages, len(s.pages) - 1)
        released = 0
        for index in range(s.first, stop):
            self._pages.release(s.pages[index])
            s.pages[index] = FREED
            released += 1
        s.first = max(s.first, stop)
        return released

    def pages_to_append(self, seq: tuple[str, str], n_tokens: int) -> int:
        """Pages ``append(seq, n_tokens)`` takes: new pages, plus one when a shared partial
        tail page is copied first."""
        s = self._get(seq)
        if n_tokens == 0:
            return 0
        cow = 1 if self._tail_needs_copy(s) else 0
        return cow + self.pages_for(s.num_tokens + n_tokens) - len(s.pages)

    def append(self, seq: tuple[str, str], n_tokens: int = 1) -> list[Slot]:
        """Reserve ``n_tokens`` more tokens; returns their slots, private to ``seq``. Grows by
        whole pages; a shared partial last page is first copied (copy-on-write)."""
        s = self._get(seq)
        _check_count("n_tokens", n_tokens)
        if n_tokens == 0:
            return []
        cow = 1 if self._tail_needs_copy(s) else 0
        grow = self.pages_for(s.num_tokens + n_tokens) - len(s.pages)
        self._pages.require(cow + grow)
        if cow:
            self._copy_page(s, len(s.pages) - 1)
        s.pages += self._take(grow)
        start, s.num_tokens = s.num_tokens, s.num_tokens + n_tokens
        return self._slots(s, start, s.num_tokens)

    def fork(self, src: tuple[str, str], dst: tuple[str, str]) -> None:
        """``dst`` starts as ``src``: same tokens, every page shared (copy-on-write)."""
        s = self._get(src)
        key = self._check_new(dst)
        for page in s.live():
            self._pages.retain(page)
        self._add(key, _Seq(list(s.pages), s.num_tokens, list(s.keys), s.computed, s.first))

    def copy_on_write(self, seq: tuple[str, str]) -> list[tuple[int, int]]:
        """Make the partial last page private if it is shared. The pool copies the page (all
        layers, K and V) itself; returns the ``(src_page, dst_page)`` pairs it copied."""
        s = self._get(seq)
        if not self._tail_needs_copy(s):
            return []
        self._pages.require(1)
        return [self._copy_page(s, len(s.pages) - 1)]

    def free(self, seq: tuple[str, str]) -> None:
        """Drop ``seq``'s block table; its pages lose one reference each."""
        key = SeqId(*seq)
        s = self._seqs.pop(key, None)
        if s is None:
            raise UnknownSequence(key)
        labels = self._labels[key.request_id]
        labels.remove(key.label)
        if not labels:
            del self._labels[key.request_id]
        for page in reversed(s.live()):  # the tail becomes least recently used: evicted first
            self._pages.release(page)

    def free_request(self, request_id: str) -> int:
        """Free every label of a request (idempotent: 0 when it holds nothing). Returns how
        many sequences were freed."""
        labels = self.labels(request_id)
        for label in labels:
            self.free(SeqId(request_id, label))
        return len(labels)

    def preempt(self, request_id: str) -> dict[str, int]:
        """Free a request's pages so that a scheduler can recompute it later. Returns the token
        count of each label it held (``sum(...)`` is the request's total)."""
        tokens = {
            lb: self._seqs[SeqId(request_id, lb)].num_tokens for lb in self.labels(request_id)
        }
        self.free_request(request_id)
        return tokens

    # ---------------------------------------------------------------------- slots and data

    def slots(self, seq: tuple[str, str], start: int = 0, end: int | None = None) -> list[Slot]:
        """Slots of tokens ``start .. end - 1`` (default: all)."""
        s = self._get(seq)
        end = s.num_tokens if end is None else end
        lo = s.first * self.page_size
        if not lo <= start <= end <= s.num_tokens:
            raise ValueError(f"need {lo} <= start <= end <= {s.num_tokens}, got {start}, {end}")
        return self._slots(s, start, end)

    def write(
        self,
        seq: tuple[str, str],
        layer: int,
        positions: Positions,
        k: torch.Tensor,  # [N, kv_heads, head_dim]
        v: torch.Tensor,  # [N, kv_heads, head_dim]
    ) -> None:
        """Write K/V of reserved token positions (distinct, < num_tokens) of one layer. Pages
        that are shared or cached are copied first, so no other sequence sees the write."""
        s = self._get(seq)
        pos = self._check_positions(s, positions)
        self._tensors.check_layer(layer)
        self._tensors.check_kv(len(pos), k, v)
        indices = sorted({p // self.page_size for p in pos})
        to_copy = [i for i in indices if self._pages.needs_copy(s.pages[i])]
        self._pages.require(len(to_copy))
        for index in to_copy:
            self._copy_page(s, index)
        for p in pos:  # K/V declared computed is being rewritten: never register that page
            if p < s.computed and p // self.page_size < len(s.keys):
                s.keys[p // self.page_size] = None
        self._tensors.write(layer, self._flat(s, pos), k, v)

    def gather(self, seq: tuple[str, str], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense copies of ``seq``'s K and V in one layer (its live positions: from
        ``first_page * page_size`` on): ``[T, kv_heads, head_dim]``, ``[T, kv_heads, v_head_dim]``."""
        s = self._get(seq)
        self._tensors.check_layer(layer)
        return self._tensors.gather(
            layer, self._flat(s, range(s.first * self.page_size, s.num_tokens))
        )

    # ---------------------------------------------------------------------- pages

    def _take(self, n_pages: int) -> list[int]:
        """``n_pages`` pages with ref 1 (``PageAllocator.take``). Their K/V are zeroed (all
        layers): attention kernels may read a page's slots past the sequence's end (masked), and
        those must never hold what an earlier owner left there (a NaN of a broken request would
        poison masked sums)."""
        pages = self._pages.take(n_pages)
        self._tensors.zero(pages)
        return pages

    def _tail_needs_copy(self, s: _Seq) -> bool:
        partial = s.num_tokens % self.page_size != 0
        return partial and self._pages.needs_copy(s.pages[-1])

    def _copy_page(self, s: _Seq, index: int) -> tuple[int, int]:
        """Give ``s`` a private copy of its page ``index`` (caller checked one page is free)."""
        src = s.pages[index]
        (dst,) = self._take(1)
        self._tensors.copy(src, dst)
        s.pages[index] = dst
        if index < len(s.keys):
            s.keys[index] = None  # conservative: a private copy is never registered
        self._pages.release(src)
        self._cow_copies += 1
        return src, dst

    # ---------------------------------------------------------------------- helpers

    def _get(self, seq: tuple[str, str]) -> _Seq:
        s = self._seqs.get(SeqId(*seq))
        if s is None:
            raise UnknownSequence(SeqId(*seq))
        return s

    def _check_new(self, seq: tuple[str, str]) -> SeqId:
        key = SeqId(*seq)
        if not isinstance(key.request_id, str) or not isinstance(key.label, str):
            raise TypeError(f"a sequence id is (request_id: str, label: str), got {seq!r}")
        if key in self._seqs:
            raise SequenceExists(f"sequence {key} already allocated")
        return key

    def _add(self, key: SeqId, s: _Seq) -> None:
        self._seqs[key] = s
        self._labels.setdefault(key.request_id, []).append(key.label)

    def _slots(self, s: _Seq, start: int, end: int) -> list[Slot]:
        size = self.page_size
        return [Slot(s.pages[t // size], t % size) for t in range(start, end)]

    def _flat(self, s: _Seq, positions: Sequence[int]) -> torch.Tensor:
        size = self.page_size
        return self._tensors.flat_index([s.pages[t // size] * size + t % size for t in positions])

    def _check_positions(self, s: _Seq, positions: Positions) -> list[int]:
        pos = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
        if len(set(pos)) != len(pos):
            raise ValueError("positions must be distinct")
        lo = s.first * self.page_size
        bad = [p for p in pos if not lo <= p < s.num_tokens]
        if bad:
            raise ValueError(
                f"positions {bad[:4]} not reserved (sequence holds [{lo}, {s.num_tokens}))"
            )
        return pos


def _check_count(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
