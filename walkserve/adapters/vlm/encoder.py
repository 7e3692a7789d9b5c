"""``VisionTower``: a vision-language model's image encoder (and projector) as its own
stateless component, with a bounded cache of its outputs by image content, as vLLM's encoder
cache: an image seen before (the same ``pixel_values`` bytes and grid) is not encoded again.

What crosses its boundary, per call (one request):

- in: ``pixel_values`` and ``image_grid_thw`` [images, 3] (``families``: the walks' contract);
- out: ``features`` [image tokens, D] (every image's, in order) and ``image_keys`` [images, 2]
  int64: per image its content key (62 bits of the BLAKE2b digest of its dtype, shape, bytes
  and grid row) and its token count. The LM component names an image's placeholder positions
  by that key in its prefix cache (``paged.PagedVLM``), so a later prompt with the same image
  reuses the KV pages after it, and a different image at the same place does not.

``forward_batch`` takes every call of a batch: each image is looked up, the misses of the
whole batch are encoded in one upstream call, and stored. The cache is LRU, bounded by the
bytes of the features it holds (``max_bytes``); an image larger than the bound is not kept.
Counters (``counters()``): ``mm_cache_queries`` (images looked up), ``mm_cache_hits``
(not encoded: found, or an image already met in the same batch), vLLM's names; the worker
reports them with its rank's stats.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.vlm.families import Family

__all__ = ["EncoderCache", "VisionTower", "image_key"]

DEFAULT_CACHE_BYTES = 256 << 20
KEY_BITS = (1 << 62) - 1


def image_key(family: str, pixels: Tensor, grid_row: Tensor) -> bytes:
    """A digest of one image's encoder input (family, dtype, shape, bytes, grid)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (family, str(pixels.dtype), str(tuple(pixels.shape)), str(grid_row.tolist())):
        h.update(part.encode() + b"\x00")
    h.update(pixels.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


class EncoderCache:
    """Features by image digest, least recently used first out, at most ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the engine loop writes; the stats reader counts
        self.queries = 0
        self.hits = 0

    def get(self, key: bytes) -> Tensor | None:
        with self._lock:
            self.queries += 1
            found = self._items.get(key)
            if found is not None:
                self.hits += 1
                self._items.move_to_end(key)
            return found

    def count(self, hit: bool) -> None:
        """Count a lookup answered without the cache (an image twice in one batch)."""
        with self._lock:
            self.queries += 1
            self.hits += int(hit)

    def put(self, key: bytes, features: Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            while self._bytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
            self._items[key] = features
            self._bytes += size

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


class VisionTower(nn.Module):
    """The image encoder of ``model`` (an upstream VLM) as a component; see the module
    docstring. The upstream modules stay where they are (``model`` is not a submodule: the
    LM component holds it)."""

    def __init__(
        self,
        model: Any,
        family: Family,
        max_bytes: int = DEFAULT_CACHE_BYTES,
        attention: Sequence[tuple[Any, str | None]] = (),
    ) -> None:
        """``attention``: the tower's configs and the attention implementation each had
        before the LM's went paged (which may set every sub-config's); the tower runs with
        those."""
        super().__init__()
        object.__setattr__(self, "upstream", model)
        self._attention = list(attention)
        self.family = family
        self.cache = EncoderCache(max_bytes)
        self._signature = inspect.signature(self.forward)

    def forward(self, pixel_values: Tensor, image_grid_thw: Tensor) -> tuple[Tensor, Tensor]:
        calls: list[tuple[Sequence[Any], dict[str, Any]]] = [((pixel_values, image_grid_thw), {})]
        result: tuple[Tensor, Tensor] = self.forward_batch(calls)[0]
        return result

    @torch.no_grad()
    def forward_batch(self, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> list[Any]:
        """Every call's (features, image_keys); the batch's cache misses in one encoder call."""
        family = self.family
        looked: list[list[tuple[bytes, Tensor | None]]] = []
        missing: dict[bytes, tuple[Tensor, Tensor]] = {}
        made: dict[bytes, Tensor] = {}
        for args, kwargs in calls:
            bound = self._signature.bind(*args, **kwargs).arguments
            pixels, grid = bound["pixel_values"], bound["image_grid_thw"].to(torch.int64)
            rows: list[tuple[bytes, Tensor | None]] = []
            for image, grid_row in zip(family.split(pixels, grid), grid):
                key = image_key(family.name, image, grid_row)
                if key in missing:  # twice in this batch: encoded once
                    self.cache.count(hit=True)
                    rows.append((key, None))
                    continue
                found = self.cache.get(key)
                if found is None:
                    missing[key] = (image, grid_row)
                rows.append((key, found))
            looked.append(rows)
        if missing:
            images = [m[0] for m in missing.values()]
            grids = [m[1] for m in missing.values()]
            with self._own_attention():
                made = dict(zip(missing, family.encode(self.upstream, images, grids)))
            for key, made_features in made.items():
                self.cache.put(key, made_features)
        out: list[Any] = []
        for rows in looked:
            images_out = [f if f is not None else made[k] for k, f in rows]
            keys = torch.tensor(
                [[int.from_bytes(k[:8], "little") & KEY_BITS, f.shape[0]] for (k, _), f in
                 zip(rows, images_out)],
                dtype=torch.int64,
            )  # fmt: skip
            out.append((torch.cat(images_out), keys))  # [tokens, D], [images, 2]
        return out

    @contextmanager
    def _own_attention(self) -> Iterator[None]:
        now = [(config, config._attn_implementation) for config, _ in self._attention]
        for config, impl in self._attention:
            config._attn_implementation = impl
        try:
            yield
        finally:
            for config, impl in now:
                config._attn_implementation = impl

    def counters(self) -> dict[str, int]:
        """The cache's counters since this process made it (see the module docstring)."""
        return {"mm_cache_queries": self.cache.queries, "mm_cache_hits": self.cache.hits}
