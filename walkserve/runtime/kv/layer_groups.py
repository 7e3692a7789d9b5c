"""Layers whose K/V live differently, each group in a pool of its own: ``GroupedKVPool``.

Owns the split of a model's attention layers into groups of one shape and one window
(``LayerGroup``), one ``KVPool`` per group, and the rule that keeps them in step: every group holds
the same sequences with the same token counts, so a scheduler sees one pool. The one thing groups
do differently: after ``mark_computed``, a sliding-window group releases the leading pages that
no later query can read (position p of the next query sees ``(p - W, p]``), so a sequence holds at
most ``ceil(W / page_size) + 1`` pages of such a group, however long it grows.

    layers      0 sliding(W=8)   1 full   2 sliding(W=8)   3 full
    groups      g0 = (0, 2): window 8      g1 = (1, 3): no window
    sequence of 30 tokens, page size 4, after its forward (the next query is position 30):
        g1 holds logical pages 0..7 (all of them)
        g0 holds logical pages 5..7 (positions 20..29; keys > 30 - 8 = 22 are read)

Page arithmetic is the same in every group (the same logical pages are taken and shared; only
their release differs), so a check ``need <= pages_available`` (the minimum over groups) is exact,
and an allocation either succeeds in every group or changes none. Prefix hits are the longest
prefix cached in every group.

What crosses the boundary: the ``KVPool`` sequence API (``allocate_with_prefix``, ``append``,
``mark_computed``, ``free``, ...) and, per group, block tables and the K/V tensors of a layer
(``kv(layer)``), for the attention runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from walkserve.runtime.kv.pool import KVPool
from walkserve.runtime.kv.pool_types import BlockTable, PoolExhausted, PoolStats, SeqId, TokenIds

__all__ = ["GroupedKVPool", "LayerGroup"]


@dataclass(frozen=True)
class LayerGroup:
    """Layers (model layer indices, ascending) that share K/V shapes and a window."""

    layers: tuple[int, ...]
    num_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"a layer group needs distinct ascending layers, got {self.layers}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")

    def pages_to_release(self, computed: int, page_size: int) -> int:
        """Leading logical pages no query at position >= ``computed`` reads: those wholly before
        ``computed - W + 1``; 0 without a window."""
        if self.window is None:
            return 0
        return max(0, computed - self.window + 1) // page_size


class GroupedKVPool:
    """One ``KVPool`` per ``LayerGroup``, kept in step (see the module docstring)."""

    def __init__(
        self,
        groups: Sequence[LayerGroup],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if not groups:
            raise ValueError("a grouped pool needs at least one layer group")
        layers = [layer for g in groups for layer in g.layers]
        if len(set(layers)) != len(layers):
            raise ValueError(f"a layer is in two groups: {sorted(layers)}")
        self.groups = tuple(groups)
        self.pools = [
            KVPool(
                num_pages,
                page_size,
                len(g.layers),
                g.kv_heads,
                g.head_dim,
                dtype,
                device,
                v_head_dim=g.v_head_dim,
            )
            for g in groups
        ]
        self.where = {
            layer: (i, j) for i, g in enumerate(groups) for j, layer in enumerate(g.layers)
        }
        """Model layer -> (group, the layer's index in its group's pool)."""

    # ---------------------------------------------------------------------- sizes

    @property
    def page_size(self) -> int:
        return self.pools[0].page_size

    @property
    def num_pages(self) -> int:
        """Pages of each group's pool (all equal)."""
        return self.pools[0].num_pages

    @property
    def num_layers(self) -> int:
        return len(self.where)

    def pages_for(self, n_tokens: int) -> int:
        return self.pools[0].pages_for(n_tokens)

    @property
    def pages_available(self) -> int:
        """Pages an allocation can get now in every group."""
        return min(p.pages_available for p in self.pools)

    def can_allocate(self, n_pages: int) -> bool:
        return n_pages <= self.pages_available

    @property
    def pages_in_use(self) -> int:
        """Pages in use, summed over groups."""
        return sum(p.pages_in_use for p in self.pools)

    @property
    def pages_cached(self) -> int:
        return sum(p.pages_cached for p in self.pools)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def stats(self) -> PoolStats:
        """Pages and bytes summed over groups; sequences, tokens and prefix counters are the
        same in every group (group 0's)."""
        each = [p.stats() for p in self.pools]
        first = each[0]
        return PoolStats(
            num_pages=sum(s.num_pages for s in each),
            page_size=first.page_size,
            pages_in_use=sum(s.pages_in_use for s in each),
            pages_free=sum(s.pages_free for s in each),
            pages_cached=sum(s.pages_cached for s in each),
            sequences=first.sequences,
            requests=first.requests,
            tokens=first.tokens,
            prefix_hits=first.prefix_hits,
            prefix_misses=first.prefix_misses,
            evictions=sum(s.evictions for s in each),
            cow_copies=sum(s.cow_copies for s in each),
            nbytes=sum(s.nbytes for s in each),
        )

    # ---------------------------------------------------------------------- per group

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V: ``[num_pages, page_size, kv_heads, head_dim]`` (V:
        ``v_head_dim``), views of its group's pool."""
        group, index = self.where[layer]
        pool = self.pools[group]
        return pool.k[index], pool.v[index]

    def block_table(self, seq: tuple[str, str], group: int = 0) -> BlockTable:
        return self.pools[group].block_table(seq)

    def block_tables(self, seq: tuple[str, str]) -> tuple[BlockTable, ...]:
        return tuple(p.block_table(seq) for p in self.pools)

    # ---------------------------------------------------------------------- sequences

    def sequences(self) -> list[SeqId]:
        return self.pools[0].sequences()

    def labels(self, request_id: str) -> list[str]:
        return self.pools[0].labels(request_id)

    def num_tokens(self, seq: tuple[str, str]) -> int:
        return self.pools[0].num_tokens(seq)

    def allocate(self, seq: tuple[str, str], n_tokens: int) -> None:
        self._require(self.pages_for(n_tokens))
        for pool in self.pools:
            pool.allocate(seq, n_tokens)

    def allocate_with_prefix(
        self,
        seq: tuple[str, str],
        token_ids: TokenIds,
        extra_key: bytes | str | None = None,
        *,
        namespace: str = "",
        max_cached_tokens: int | None = None,
    ) -> int:
        """``KVPool.allocate_with_prefix`` in every group, reusing the prefix cached in all of
        them; returns the cached token count."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        cached = min(
            p.cached_prefix_tokens(
                ids, extra_key, namespace=namespace, max_cached_tokens=max_cached_tokens
            )
            for p in self.pools
        )
        done: list[KVPool] = []
        try:
            for pool in self.pools:
                got = pool.allocate_with_prefix(
                    seq, ids, extra_key, namespace=namespace, max_cached_tokens=cached
                )
                done.append(pool)
                assert got == cached, (got, cached)
        except PoolExhausted:
            for pool in done:
                pool.free(seq)
            raise
        return cached

    def append(self, seq: tuple[str, str], n_tokens: int = 1) -> None:
        """Reserve ``n_tokens`` more tokens in every group (all or none)."""
        for p in self.pools:
            need = p.pages_to_append(seq, n_tokens)
            if need > p.pages_available:
                raise PoolExhausted(needed=need, free=p.pages_available)
        for p in self.pools:
            p.append(seq, n_tokens)

    def mark_computed(self, seq: tuple[str, str], n_tokens: int | None = None) -> int:
        """``KVPool.mark_computed`` in every group, then each windowed group releases the pages
        no later query reads. Returns the pages cached in group 0."""
        n = self.num_tokens(seq) if n_tokens is None else n_tokens
        cached = [p.mark_computed(seq, n) for p in self.pools]
        for group, pool in zip(self.groups, self.pools):
            release = group.pages_to_release(n, pool.page_size)
            if release:
                pool.release_leading(seq, release)
        return cached[0]

    def fork(self, src: tuple[str, str], dst: tuple[str, str]) -> None:
        for pool in self.pools:
            pool.fork(src, dst)

    def free(self, seq: tuple[str, str]) -> None:
        for pool in self.pools:
            pool.free(seq)

    def free_request(self, request_id: str) -> int:
        counts = [p.free_request(request_id) for p in self.pools]  # every group, not just one
        return counts[0]

    def preempt(self, request_id: str) -> dict[str, int]:
        tokens = [p.preempt(request_id) for p in self.pools]
        return tokens[0]

    def _require(self, n_pages: int) -> None:
        if n_pages > self.pages_available:
            raise PoolExhausted(needed=n_pages, free=self.pages_available)
