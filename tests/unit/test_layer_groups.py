"""Freeing the pages a sliding window left behind (``KVPool.release_leading``), value heads of
their own size, and ``GroupedKVPool``: groups kept in step, each sliding group's memory bounded by
its window however long a sequence grows, allocations all-or-none, prefix hits only where every
group has the prefix."""

from __future__ import annotations

import pytest
import torch

from walkserve.runtime.kv import KVPool, PoolExhausted, SeqId
from walkserve.runtime.kv.layer_groups import GroupedKVPool, LayerGroup

A, B = SeqId("a", "t"), SeqId("b", "t")


def test_value_heads_of_their_own_size() -> None:
    pool = KVPool(4, 2, 1, 2, 6, torch.float32, v_head_dim=3)
    assert pool.k.shape == (1, 4, 2, 2, 6) and pool.v.shape == (1, 4, 2, 2, 3)
    assert pool.nbytes == pool.config.nbytes == 4 * 2 * 2 * (6 + 3) * 4
    pool.allocate(A, 3)
    pool.write(A, 0, [0, 1, 2], torch.ones(3, 2, 6), torch.full((3, 2, 3), 2.0))
    k, v = pool.gather(A, 0)
    assert k.shape == (3, 2, 6) and v.shape == (3, 2, 3) and bool((v == 2).all())
    with pytest.raises(ValueError, match=r"\[1, 2, 6\], \[1, 2, 3\]"):
        pool.write(A, 0, [0], torch.ones(1, 2, 6), torch.ones(1, 2, 6))


def test_release_leading_frees_pages_and_shifts_the_block_table() -> None:
    pool = KVPool(8, 4, 1, 1, 2, torch.float32)
    pool.allocate(A, 14)  # logical pages 0..3
    pages = pool.block_table(A).pages
    assert pool.release_leading(A, 2) == 2
    table = pool.block_table(A)
    assert (table.pages, table.first_page, table.num_tokens) == (pages[2:], 2, 14)
    assert pool.pages_in_use == 2 and pool.pages_free == 6
    assert pool.release_leading(A, 1) == 0  # already gone
    assert pool.release_leading(A, 9) == 1  # never the last page
    assert pool.block_table(A).pages == pages[3:]
    with pytest.raises(ValueError, match="not reserved"):
        pool.write(A, 0, [5], torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    pool.write(A, 0, [13], torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    k, _ = pool.gather(A, 0)
    assert k.shape == (2, 1, 2)  # positions 12, 13
    pool.append(A, 3)  # grows past the page boundary as usual
    assert pool.block_table(A).first_page == 3 and len(pool.block_table(A).pages) == 2
    pool.free(A)
    assert pool.pages_in_use == 0 and pool.pages_free == 8


def test_released_prefix_pages_stay_cached_for_others() -> None:
    pool = KVPool(8, 4, 1, 1, 2, torch.float32)
    ids = list(range(20, 33))  # 13 tokens: 3 full pages
    pool.allocate_with_prefix(A, ids)
    pool.mark_computed(A)
    pool.release_leading(A, 2)
    assert pool.pages_cached == 2  # registered full pages park, evictable
    assert pool.cached_prefix_tokens(ids) == 12
    assert pool.allocate_with_prefix(B, ids, max_cached_tokens=12) == 12
    assert pool.pages_cached == 0


def groups(window: int | None = 8) -> list[LayerGroup]:
    return [
        LayerGroup((0, 2), 4, 2, 8, 8, window),  # sliding
        LayerGroup((1, 3), 4, 2, 8, 8, None),  # full
    ]


def test_groups_validate_and_map_layers() -> None:
    pool = GroupedKVPool(groups(), 16, 4, torch.float32)
    assert pool.where == {0: (0, 0), 2: (0, 1), 1: (1, 0), 3: (1, 1)}
    k, v = pool.kv(2)
    assert k.data_ptr() == pool.pools[0].k[1].data_ptr() and v.shape == (16, 4, 2, 8)
    with pytest.raises(ValueError, match="two groups"):
        GroupedKVPool(
            [LayerGroup((0,), 1, 1, 1, 1), LayerGroup((0,), 1, 1, 1, 1)], 4, 4, torch.float32
        )
    with pytest.raises(ValueError, match="ascending"):
        LayerGroup((2, 1), 1, 1, 1, 1)


@pytest.mark.parametrize("window", [1, 4, 8, 10])
def test_a_sliding_group_holds_at_most_window_over_page_plus_one_pages(window: int) -> None:
    """A sequence of 10 windows: after every step's mark_computed, the sliding group holds at
    most ceil(window / page) + 1 pages while the full group holds them all."""
    page = 4
    pool = GroupedKVPool(groups(window), 64, page, torch.float32)
    pool.allocate(A, 5)
    pool.mark_computed(A, 5)
    bound = -(-window // page) + 1
    for n in range(6, 10 * window + 6):
        pool.append(A, 1)
        pool.mark_computed(A, n)
        sliding, full = pool.block_tables(A)
        assert len(sliding.pages) <= bound, (n, sliding)
        assert len(full.pages) == pool.pages_for(n) and full.first_page == 0
        # the pages kept cover every key the next query (position n) reads
        assert sliding.first_page * page <= max(0, n - window + 1)
    assert pool.pools[0].pages_in_use <= bound
    pool.free(A)
    assert pool.pages_in_use == 0


def test_allocations_are_all_or_none_and_prefixes_need_every_group() -> None:
    pool = GroupedKVPool(groups(4), 6, 4, torch.float32)
    ids = list(range(40, 53))  # 13 tokens, 4 pages
    pool.allocate_with_prefix(A, ids)
    pool.mark_computed(A)  # registers 3 full pages per group; the sliding one frees 2 of them
    assert pool.pools[0].pages_in_use == 2 and pool.pools[1].pages_in_use == 4
    assert pool.pages_available == 2  # the full group is the binding one
    with pytest.raises(PoolExhausted):
        pool.allocate(B, 12)  # 3 pages: the sliding group has them, the full one does not
    assert pool.sequences() == [A] and pool.pools[0].sequences() == [A]
    pool.free(A)
    # both groups still cache the prefix: a hit of 12 tokens in each
    assert pool.allocate_with_prefix(B, ids, max_cached_tokens=12) == 12
    pool.free(B)
    # One group loses its least recently used cached page, the prefix's third (freeing releases
    # the tail first): every group's hit stops before it, although the other still has it.
    pool.pools[0]._prefix.evict()
    assert pool.pools[1].cached_prefix_tokens(ids, max_cached_tokens=12) == 12
    assert pool.allocate_with_prefix(A, ids, max_cached_tokens=12) == 8
    assert pool.stats().prefix_hits == 3 + 2  # counted once per allocation, not per group
