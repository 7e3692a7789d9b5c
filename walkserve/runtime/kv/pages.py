"""The page allocator of a paged KV pool: which page ids are free, in use, or cached.

Owns the reference count of every page, the free list, and the hand-off of pages to and from the
prefix cache's evictable set (``prefix.PrefixCache``, which the pool shares with it). It owns no
tensors and no block tables: the pool (``pool.py``) asks it for pages (``take``), tells it when a
block-table entry starts or stops naming a page (``retain``, ``release``), and zeroes or copies
the pages' K/V itself. What crosses the boundary is page ids (``int``) and ``PoolExhausted``.

Page lifecycle; ``ref`` counts the block-table entries naming a page::

    free --take--> in use (ref >= 1) --last release, unregistered--> free
                     ^        |
          prefix hit |        | last release of a page registered in the prefix cache
                     |        v
                   cached, evictable (LRU) --evicted when no page is free--> taken again

    num_in_use + num_free + num_cached == num_pages, always.
"""

from __future__ import annotations

from walkserve.runtime.kv.pool_types import PoolExhausted
from walkserve.runtime.kv.prefix import PrefixCache

__all__ = ["PageAllocator"]


class PageAllocator:
    """Reference counts and the free list of ``num_pages`` pages; cached pages live in
    ``prefix`` while nobody references them. Not thread-safe (its pool's engine thread owns it)."""

    def __init__(self, num_pages: int, prefix: PrefixCache) -> None:
        self.prefix = prefix
        self._ref = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest id pops first
        self._in_use = 0

    @property
    def num_in_use(self) -> int:
        return self._in_use

    @property
    def num_free(self) -> int:  # cached (evictable) pages not counted
        return len(self._free)

    @property
    def num_cached(self) -> int:  # referenced by nobody, evictable
        return self.prefix.num_evictable

    @property
    def num_available(self) -> int:  # what a ``take`` can get now
        return self.num_free + self.num_cached

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def require(self, n_pages: int, reviving: int = 0) -> None:
        """Raise unless ``n_pages`` can be taken after ``reviving`` evictable pages are
        re-referenced (they stop being obtainable)."""
        obtainable = self.num_available - reviving
        if n_pages > obtainable:
            raise PoolExhausted(needed=n_pages, free=obtainable)

    def take(self, n_pages: int) -> list[int]:
        """``n_pages`` pages with ref 1: free ones first, then evicted cached ones (LRU). Raises
        ``PoolExhausted`` before taking any when fewer are available."""
        self.require(n_pages)
        pages = [self._free.pop() if self._free else self.prefix.evict() for _ in range(n_pages)]
        for page in pages:
            self._ref[page] = 1
        self._in_use += n_pages
        return pages

    def retain(self, page: int) -> None:
        """One more block-table entry names ``page`` (revives it if it was cached, evictable)."""
        if self._ref[page] == 0:
            self.prefix.unpark(page)
            self._in_use += 1
        self._ref[page] += 1

    def release(self, page: int) -> None:
        """One block-table entry less names ``page``; after the last, it turns free, or cached
        and evictable if it is registered in the prefix cache."""
        self._ref[page] -= 1
        if self._ref[page] > 0:
            return
        self._in_use -= 1
        if self.prefix.is_registered(page):
            self.prefix.park(page)
        else:
            self._free.append(page)

    def needs_copy(self, page: int) -> bool:
        """Must a writer copy ``page`` first: is it shared, or registered in the prefix cache?"""
        return self._ref[page] > 1 or self.prefix.is_registered(page)
