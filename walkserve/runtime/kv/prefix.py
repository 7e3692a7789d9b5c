"""Prefix caching for the paged KV pool: content keys for full pages, and the cache index.

Owns how a full page is named (``page_keys``, ``root_key``, ``features_key``) and which pages
are cached under which key, with an LRU order over the cached pages nobody references
(``PrefixCache``). It owns no tensors and no reference counts: the pool's page allocator
(``pages.py``) tells it when a registered page loses its last reference (``park``) or gains one
again (``unpark``), and asks it for a victim (``evict``) when it runs out of free pages. What
crosses the boundary is page ids (``int``) and keys (``bytes``).

A page's key names the whole prefix up to and including that page, so two pages match only when
everything before them matched too::

    root  = H(version, namespace, extra_key)          # model/adapter id; image/audio features
    key_0 = H(root,  tokens[0        : S])            # S = page_size
    key_1 = H(key_0, tokens[S        : 2S])
    key_i = H(key_(i-1), tokens[iS   : (i+1)S])       # full pages only; a partial tail has none

The label of a sequence ("cond", "uncond", ...) is *not* part of the key. K/V of a causal model
are a function of the inputs alone, so two labelled contexts with the same tokens, namespace and
extra key hold the same K/V and may share pages; whatever differs between labelled contexts (a
text prompt, an image) must differ in the tokens or in ``extra_key``. ``extra_key`` applies to
the whole sequence (conservative: a text page before an image is not shared with a text-only
prompt). Keys are BLAKE2b digests, stable across processes (unlike ``hash()``).

Page states seen from here::

    registered, referenced  --park-->  registered, evictable (LRU tail = most recent)
            ^                                |              |
            +------------unpark--------------+            evict
                                                            v
                                                 forgotten (the pool reuses the page)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "PrefixStats", "features_key", "page_keys", "root_key"]

_VERSION = b"walkserve-kv-prefix-v1"
_DIGEST_BYTES = 16


def _digest(*parts: bytes) -> bytes:
    """BLAKE2b over length-prefixed parts, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


def _as_bytes(key: bytes | str | None) -> bytes:
    if key is None:
        return b"\x00"
    if isinstance(key, str):
        return b"s" + key.encode()
    return b"b" + key


def root_key(namespace: str = "", extra_key: bytes | str | None = None) -> bytes:
    """The key every chain starts from: the model/adapter id and the multimodal extra key."""
    return _digest(_VERSION, namespace.encode(), _as_bytes(extra_key))


def features_key(*features: torch.Tensor) -> bytes:
    """A digest of feature tensors (image patches, audio frames) to pass as ``extra_key``.

    Dtype, shape and the bytes of each tensor count; two tensors equal in value but of different
    dtype give different keys."""
    parts: list[bytes] = []
    for t in features:
        t = t.detach().to("cpu").contiguous()
        parts += [str(t.dtype).encode(), str(tuple(t.shape)).encode()]
        parts.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return _digest(b"features", *parts)


def page_keys(token_ids: Sequence[int], page_size: int, root: bytes) -> list[bytes]:
    """One chained key per *full* page of ``token_ids`` (``len // page_size`` keys)."""
    page = struct.Struct(f"<{page_size}q")  # int64 little-endian: the same on every host
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = _digest(parent, page.pack(*token_ids[start : start + page_size]))
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class PrefixStats:
    """Counters since the cache was made. Hits and misses count full pages looked up by
    successful allocations; ``evictions`` counts cached pages handed back for reuse."""

    cached_pages: int
    evictable_pages: int
    hits: int
    misses: int
    evictions: int


class PrefixCache:
    """Key <-> page index of registered full pages, plus the LRU of evictable ones.

    Not thread-safe: owned by the pool, which is owned by one engine thread."""

    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # ---------------------------------------------------------------------- lookups

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """Pages of the longest cached prefix of ``keys`` (stops at the first miss). Pure: no
        counters, no LRU change; the pool commits a lookup with ``record``."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def record(self, hits: int, misses: int) -> None:
        self.hits += hits
        self.misses += misses

    def is_registered(self, page: int) -> bool:
        return page in self._key_of

    def is_evictable(self, page: int) -> bool:
        return page in self._lru

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def evictable_pages(self) -> list[int]:
        """Evictable pages, least recently used first (the eviction order)."""
        return list(self._lru)

    # ---------------------------------------------------------------------- transitions

    def register(self, key: bytes, page: int) -> bool:
        """Cache ``page`` under ``key``. False (and no change) when ``key`` is already cached
        under another page or ``page`` under another key: the first registration wins."""
        if key in self._page_of or page in self._key_of:
            return self._page_of.get(key) == page
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def park(self, page: int) -> None:
        """A registered page lost its last reference: it becomes the most recently used
        evictable page."""
        assert page in self._key_of and page not in self._lru, page
        self._lru[page] = None

    def unpark(self, page: int) -> None:
        """An evictable page is referenced again (a prefix hit): no longer evictable."""
        del self._lru[page]

    def evict(self) -> int:
        """Forget the least recently used evictable page and return it for reuse."""
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.evictions += 1
        return page

    def stats(self) -> PrefixStats:
        return PrefixStats(
            cached_pages=len(self._key_of),
            evictable_pages=len(self._lru),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
        )
