"""The paged KV pool's memory manager: layout, block tables, copy-on-write, prefix caching, LRU
eviction, exhaustion, labels; then a hypothesis state machine that checks the accounting and
every sequence's K/V against dense reference tensors after random operation sequences.

K/V written under prefix caching come from ``fake_kv``, a deterministic stand-in for a causal
model (position t's K/V depend on the namespace, extra key and tokens 0..t only), so a prefix
hit can be checked against what the request would have computed itself."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from walkserve.runtime.kv import (
    KVPool,
    KVPoolConfig,
    PoolExhausted,
    SeqId,
    SequenceExists,
    Slot,
    UnknownSequence,
    features_key,
)

LAYERS, HEADS, DIM = 2, 2, 3


def make_pool(num_pages: int = 16, page_size: int = 4, device: str = "cpu") -> KVPool:
    return KVPool(num_pages, page_size, LAYERS, HEADS, DIM, torch.float32, device)


def fake_kv(tokens: list[int], extra: str | None = None) -> torch.Tensor:
    """K/V a causal model would compute for ``tokens``: ``[T, 2 (k|v), LAYERS, HEADS, DIM]``."""
    out = []
    for t in range(len(tokens)):
        digest = hashlib.blake2b(repr((extra, tokens[: t + 1])).encode(), digest_size=7).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        out.append(torch.randn(2, LAYERS, HEADS, DIM, generator=gen))
    return torch.stack(out) if out else torch.zeros(0, 2, LAYERS, HEADS, DIM)


def write_all(pool: KVPool, seq: SeqId, values: torch.Tensor, start: int = 0) -> None:
    """Write ``values`` ([N, 2, L, H, D]) at positions start .. start + N - 1, every layer."""
    positions = list(range(start, start + values.shape[0]))
    for layer in range(LAYERS):
        pool.write(seq, layer, positions, values[:, 0, layer], values[:, 1, layer])


def dense(pool: KVPool, seq: SeqId) -> torch.Tensor:
    """All of ``seq``'s K/V as ``[T, 2, L, H, D]``."""
    per_layer = [torch.stack(pool.gather(seq, layer), dim=1) for layer in range(LAYERS)]
    return torch.stack(per_layer, dim=2)


def prefill(pool: KVPool, seq: SeqId, tokens: list[int], extra: str | None = None) -> int:
    """Allocate with prefix reuse, compute the uncached rest, register it; returns n_cached."""
    cached = pool.allocate_with_prefix(seq, tokens, extra)
    write_all(pool, seq, fake_kv(tokens, extra)[cached:], start=cached)
    pool.mark_computed(seq)
    return cached


A, B, C = SeqId("a", "cond"), SeqId("b", "cond"), SeqId("c", "cond")


# ------------------------------------------------------------------------ layout


def test_layout_and_exact_nbytes() -> None:
    pool = KVPool(10, 16, 3, 4, 8, torch.bfloat16)
    assert pool.k.shape == pool.v.shape == (3, 10, 16, 4, 8)
    assert pool.k.dtype == torch.bfloat16
    assert pool.nbytes == 2 * 3 * 10 * 16 * 4 * 8 * 2
    assert pool.nbytes == pool.config.nbytes == pool.stats().nbytes
    assert pool.config.bytes_per_page * 10 == pool.nbytes


def test_pool_is_never_reallocated() -> None:
    pool = make_pool(num_pages=4)
    ptrs = (pool.k.data_ptr(), pool.v.data_ptr())
    prefill(pool, A, list(range(7)))
    pool.fork(A, B)
    pool.append(B, 3)
    write_all(pool, B, torch.ones(3, 2, LAYERS, HEADS, DIM), start=7)
    pool.free_request("a")
    with pytest.raises(PoolExhausted):
        pool.append(B, 100)
    assert (pool.k.data_ptr(), pool.v.data_ptr()) == ptrs
    assert pool.k.shape == (LAYERS, 4, 4, HEADS, DIM)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_pages": 0},
        {"page_size": -1},
        {"num_layers": True},
        {"head_dim": 2.0},
        {"dtype": "float32"},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = dict(
        num_pages=4, page_size=4, num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        KVPoolConfig(**args)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ block tables


def test_append_grows_by_whole_pages_and_returns_slots() -> None:
    pool = make_pool()
    pool.allocate(A, 0)
    assert pool.block_table(A).pages == () and pool.pages_in_use == 0
    slots = pool.append(A, 3)
    (page,) = pool.block_table(A).pages
    assert slots == [Slot(page, 0), Slot(page, 1), Slot(page, 2)]
    slots = pool.append(A, 6)  # 9 tokens: 3 pages
    table = pool.block_table(A)
    assert table.num_tokens == 9 and len(table.pages) == 3 and pool.pages_in_use == 3
    assert slots == pool.slots(A, 3, 9)
    assert [s.page for s in slots] == [page, table.pages[1], *[table.pages[1]] * 3, table.pages[2]]
    assert slots[-1] == Slot(table.pages[2], 0)


def test_slots_address_the_pool_directly() -> None:
    pool = make_pool()
    pool.allocate(A, 6)
    values = fake_kv(list(range(6)))
    write_all(pool, A, values)
    for t, slot in enumerate(pool.slots(A)):
        assert torch.equal(pool.k[1, slot.page, slot.offset], values[t, 0, 1])
        flat = pool.v[0].view(-1, HEADS, DIM)[slot.flat(pool.page_size)]
        assert torch.equal(flat, values[t, 1, 0])


def test_sequence_errors() -> None:
    pool = make_pool()
    pool.allocate(A, 2)
    with pytest.raises(SequenceExists):
        pool.allocate(A, 1)
    with pytest.raises(SequenceExists):
        pool.fork(A, A)
    with pytest.raises(UnknownSequence):
        pool.append(B)
    with pytest.raises(UnknownSequence):
        pool.free(B)
    with pytest.raises(ValueError, match="not reserved"):
        pool.write(A, 0, [2], torch.zeros(1, HEADS, DIM), torch.zeros(1, HEADS, DIM))
    with pytest.raises(ValueError, match="distinct"):
        pool.write(A, 0, [1, 1], torch.zeros(2, HEADS, DIM), torch.zeros(2, HEADS, DIM))
    with pytest.raises(ValueError, match="layer"):
        pool.gather(A, LAYERS)
    with pytest.raises(ValueError, match="must be"):
        pool.write(A, 0, [0], torch.zeros(1, HEADS + 1, DIM), torch.zeros(1, HEADS, DIM))
    with pytest.raises(ValueError):
        pool.allocate(B, -1)


# ------------------------------------------------------------------------ copy-on-write


def test_fork_shares_pages_and_copy_on_write_keeps_the_source() -> None:
    pool = make_pool()
    pool.allocate(A, 6)  # pages: full, partial
    source = fake_kv(list(range(6)))
    write_all(pool, A, source)
    pool.fork(A, B)
    full, tail = pool.block_table(A).pages
    assert pool.block_table(B).pages == (full, tail)
    assert pool.ref_count(full) == pool.ref_count(tail) == 2 and pool.pages_in_use == 2

    slots = pool.append(B, 1)  # first write into the shared partial page: B gets a copy
    b_full, b_tail = pool.block_table(B).pages
    assert b_full == full and b_tail != tail and slots == [Slot(b_tail, 2)]
    assert pool.ref_count(tail) == 1 and pool.ref_count(b_tail) == 1
    assert pool.stats().cow_copies == 1
    write_all(pool, B, torch.full((1, 2, LAYERS, HEADS, DIM), 9.0), start=6)
    write_all(pool, B, torch.zeros(2, 2, LAYERS, HEADS, DIM), start=2)  # shared full page
    assert pool.block_table(B).pages[0] != full and pool.stats().cow_copies == 2

    assert torch.equal(dense(pool, A), source)  # the source never changed
    got = dense(pool, B)
    assert torch.equal(got[:2], source[:2]) and torch.equal(got[4:6], source[4:6])
    assert (got[2:4] == 0).all() and (got[6] == 9).all()
    assert pool.copy_on_write(A) == []  # A's tail is private again


def test_copy_on_write_reports_the_pairs_it_copied() -> None:
    pool = make_pool()
    pool.allocate(A, 5)
    write_all(pool, A, fake_kv(list(range(5))))
    pool.fork(A, B)
    tail = pool.block_table(A).pages[-1]
    ((src, dst),) = pool.copy_on_write(B)
    assert src == tail and pool.block_table(B).pages[-1] == dst
    assert torch.equal(pool.k[:, dst], pool.k[:, src]) and torch.equal(
        pool.v[:, dst], pool.v[:, src]
    )
    assert pool.copy_on_write(B) == [] and pool.copy_on_write(A) == []


def test_fork_of_a_page_aligned_sequence_copies_nothing_on_append() -> None:
    pool = make_pool()
    pool.allocate(A, 8)
    pool.fork(A, B)
    pool.append(A, 1)
    pool.append(B, 1)
    assert pool.stats().cow_copies == 0
    assert pool.block_table(A).pages[:2] == pool.block_table(B).pages[:2]
    assert pool.block_table(A).pages[2] != pool.block_table(B).pages[2]


# ------------------------------------------------------------------------ labels


def test_labels_over_one_pool_match_separate_dense_caches() -> None:
    """A guided walk: "cond" and "uncond" contexts of one request over one pool gather exactly
    what two dense per-context caches grown by concatenation hold."""
    pool = make_pool(num_pages=12)
    cond, uncond = SeqId("r", "cond"), SeqId("r", "uncond")
    gen = torch.Generator().manual_seed(0)
    caches: dict[SeqId, torch.Tensor] = {}
    for seq, prompt_len in [(cond, 7), (uncond, 3)]:
        caches[seq] = torch.randn(prompt_len, 2, LAYERS, HEADS, DIM, generator=gen)
        pool.allocate(seq, prompt_len)
        write_all(pool, seq, caches[seq])
    for step in range(6):
        for seq in (cond, uncond):
            new = torch.randn(1 + step % 3, 2, LAYERS, HEADS, DIM, generator=gen)
            start = pool.num_tokens(seq)
            pool.append(seq, new.shape[0])
            write_all(pool, seq, new, start=start)
            caches[seq] = torch.cat([caches[seq], new])  # the dense baseline
    for seq in (cond, uncond):
        for layer in range(LAYERS):
            k, v = pool.gather(seq, layer)
            assert torch.equal(k, caches[seq][:, 0, layer])
            assert torch.equal(v, caches[seq][:, 1, layer])
    assert pool.labels("r") == ["cond", "uncond"]
    assert not set(pool.block_table(cond).pages) & set(pool.block_table(uncond).pages)
    assert len(pool.pages_of("r")) == pool.pages_in_use
    assert pool.free_request("r") == 2 and pool.pages_in_use == 0
    assert pool.free_request("r") == 0


def test_preempt_returns_token_counts_and_frees_every_label() -> None:
    pool = make_pool()
    pool.allocate(SeqId("r", "cond"), 9)
    pool.allocate(SeqId("r", "uncond"), 2)
    pool.allocate(B, 4)
    assert pool.preempt("r") == {"cond": 9, "uncond": 2}
    assert pool.pages_of("r") == frozenset() and pool.pages_in_use == 1
    assert pool.preempt("r") == {}
    pool.free(B)
    assert pool.pages_in_use == 0 and pool.pages_free == pool.num_pages


# ------------------------------------------------------------------------ prefix caching


def test_prefix_hit_shares_full_pages_and_reproduces_kv() -> None:
    pool = make_pool()
    tokens = list(range(100, 110))  # 2 full pages + 2 tokens
    assert prefill(pool, A, tokens) == 0
    assert prefill(pool, B, tokens) == 8
    a, b = pool.block_table(A).pages, pool.block_table(B).pages
    assert a[:2] == b[:2] and a[2] != b[2]  # the partial last page is never shared
    assert pool.ref_count(a[0]) == 2 and pool.ref_count(a[2]) == 1
    assert torch.equal(dense(pool, B), fake_kv(tokens))
    stats = pool.stats()
    assert (stats.prefix_hits, stats.prefix_misses) == (2, 2)


def test_prefix_is_label_independent_but_respects_namespace_and_extra_key() -> None:
    pool = make_pool(num_pages=32)
    tokens = list(range(8))
    prefill(pool, SeqId("r1", "cond"), tokens, extra="img-1")
    assert prefill(pool, SeqId("r2", "image"), tokens, extra="img-1") == 8
    assert prefill(pool, SeqId("r3", "cond"), tokens, extra="img-2") == 0
    assert prefill(pool, SeqId("r4", "cond"), tokens) == 0
    assert pool.allocate_with_prefix(SeqId("r5", "cond"), tokens, "img-1", namespace="lora") == 0


def test_prefix_keys_chain_the_whole_prefix() -> None:
    pool = make_pool()
    prefill(pool, A, [1, 2, 3, 4, 5, 6, 7, 8])
    assert pool.allocate_with_prefix(B, [9, 9, 9, 9, 5, 6, 7, 8]) == 0  # same second page
    assert pool.allocate_with_prefix(C, [1, 2, 3, 4, 0, 0, 0, 0]) == 4


def test_pages_are_shared_only_once_computed() -> None:
    pool = make_pool()
    pool.allocate_with_prefix(A, list(range(8)))
    assert pool.allocate_with_prefix(B, list(range(8))) == 0  # A's K/V not written yet
    write_all(pool, A, fake_kv(list(range(8))))
    assert pool.mark_computed(A, 5) == 1
    assert pool.allocate_with_prefix(C, list(range(8))) == 4
    assert pool.allocate_with_prefix(SeqId("d", "x"), list(range(8)), max_cached_tokens=3) == 0


def test_freed_prefix_stays_cached_and_is_revived() -> None:
    pool = make_pool(num_pages=4)
    tokens = list(range(9))
    prefill(pool, A, tokens)
    pool.free(A)
    assert pool.pages_in_use == 0 and pool.pages_cached == 2 and pool.pages_free == 2
    assert prefill(pool, B, tokens) == 8
    assert pool.pages_cached == 0 and pool.pages_in_use == 3
    assert torch.equal(dense(pool, B), fake_kv(tokens))


def test_rewriting_a_cached_page_copies_it() -> None:
    pool = make_pool()
    tokens = list(range(8))
    prefill(pool, A, tokens)
    cached = pool.block_table(A).pages[0]
    write_all(pool, A, torch.zeros(1, 2, LAYERS, HEADS, DIM), start=0)
    assert pool.block_table(A).pages[0] != cached and cached in pool.evictable_pages()
    assert prefill(pool, B, tokens) == 8
    assert torch.equal(dense(pool, B), fake_kv(tokens))


def test_rewritten_computed_kv_is_never_registered() -> None:
    pool = make_pool(num_pages=4)
    tokens = list(range(4))
    prefill(pool, A, tokens)
    pool.fork(A, B)
    pool.free(A)
    garbage = torch.full((1, 2, LAYERS, HEADS, DIM), 7.0)
    write_all(pool, B, garbage, start=1)  # copies the cached page; the copy has no key
    pool.allocate(C, 12)  # evicts the original page
    assert pool.stats().evictions == 1
    pool.free(C)
    assert pool.mark_computed(B) == 0
    assert prefill(pool, SeqId("d", "x"), tokens) == 0

    pool = make_pool(num_pages=4)
    for seq in (A, B):  # both miss: B computes a duplicate of A's page
        assert pool.allocate_with_prefix(seq, tokens) == 0
        write_all(pool, seq, fake_kv(tokens))
    assert pool.mark_computed(A) == 1 and pool.mark_computed(B) == 0
    write_all(pool, B, garbage, start=1)  # in place (private, unregistered): drops B's key
    pool.free(A)
    pool.allocate(C, 12)  # evicts A's page
    pool.free(C)
    assert pool.mark_computed(B) == 0
    assert prefill(pool, SeqId("d", "x"), tokens) == 0


def test_features_key() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert features_key(x) == features_key(x.clone())
    assert features_key(x) != features_key(x + 1)
    assert features_key(x) != features_key(x.double())
    assert features_key(x) != features_key(x.reshape(3, 2))
    assert features_key(x, x) != features_key(x)


# ------------------------------------------------------------------------ eviction and exhaustion


def test_eviction_is_lru_and_only_of_unreferenced_pages() -> None:
    pool = make_pool(num_pages=6, page_size=2)
    prefill(pool, A, [1, 1, 1, 1])
    a0, a1 = pool.block_table(A).pages
    pool.free(A)
    assert pool.evictable_pages() == [a1, a0]  # freed tail first: the tail is evicted first
    prefill(pool, B, [2, 2, 2, 2])
    b0, b1 = pool.block_table(B).pages
    pool.free(B)
    assert pool.evictable_pages() == [a1, a0, b1, b0]
    assert prefill(pool, A, [1, 1, 1, 1]) == 4  # revives a0, a1
    pool.free(A)
    assert pool.evictable_pages() == [b1, b0, a1, a0]

    prefill(pool, C, [3, 3])  # one held, cached page
    c0 = pool.block_table(C).pages[0]
    pool.allocate(SeqId("d", "x"), 2 * pool.page_size)  # 1 free page, evicts b1
    assert pool.evictable_pages() == [b0, a1, a0] and pool.stats().evictions == 1
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(SeqId("e", "x"), 4 * pool.page_size)
    assert (info.value.needed, info.value.free) == (4, 3)
    pool.allocate(SeqId("e", "x"), 3 * pool.page_size)  # evicts all three
    assert pool.stats().evictions == 4 and pool.evictable_pages() == []
    assert pool.ref_count(c0) == 1 and pool.is_cached(c0)  # referenced: never evicted
    assert pool.allocate_with_prefix(SeqId("f", "x"), [3, 3]) == 2
    pool.free(SeqId("e", "x"))
    assert pool.allocate_with_prefix(SeqId("g", "x"), [1, 1]) == 0  # a0 was evicted


def test_exhaustion_is_typed_and_changes_nothing() -> None:
    pool = make_pool(num_pages=4)
    pool.allocate(A, 10)  # 3 pages
    pool.fork(A, B)
    before = (pool.block_table(A), pool.block_table(B), pool.stats(), pool.k.clone())
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(PoolExhausted) as info:
        pool.append(A, 3)  # a copy of the shared tail + one new page
    assert (info.value.needed, info.value.free) == (2, 1)
    with pytest.raises(PoolExhausted):
        pool.allocate(C, 5)
    with pytest.raises(PoolExhausted):
        pool.allocate_with_prefix(C, list(range(5)))
    after = (pool.block_table(A), pool.block_table(B), pool.stats(), pool.k)
    assert before[:3] == after[:3] and torch.equal(before[3], after[3])
    pool.append(A, 2)  # exactly the copy of the shared tail
    assert pool.pages_free == 0 and pool.stats().cow_copies == 1


def test_revived_hits_are_not_counted_as_obtainable() -> None:
    pool = make_pool(num_pages=3)
    prefill(pool, A, list(range(8)))
    pool.free(A)  # 2 cached, 1 free
    with pytest.raises(PoolExhausted) as info:
        pool.allocate_with_prefix(B, list(range(16)))  # reuses 2, needs 2 more of 1
    assert (info.value.needed, info.value.free) == (2, 1)
    assert pool.pages_cached == 2 and pool.stats().prefix_hits == 0


# ------------------------------------------------------------------------ state machine

PAGE, PAGES = 4, 20
REQUESTS = ["r0", "r1", "r2"]
LABELS = ["cond", "uncond", "image"]
PROMPTS = [list(range(1, 10)), [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]
EXTRAS = [None, "img-a"]


class KVPoolMachine(RuleBasedStateMachine):
    """Random allocate/prefix/append/write/fork/CoW/free/preempt over requests x labels.

    The model keeps, per sequence, a dense ``[T, 2, L, H, D]`` tensor of what was written (and a
    known-mask for reserved, unwritten positions) and a fork family id."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(PAGES, PAGE, LAYERS, HEADS, DIM, torch.float32)
        self.ptrs = (self.pool.k.data_ptr(), self.pool.v.data_ptr())
        self.expected: dict[SeqId, torch.Tensor] = {}
        self.known: dict[SeqId, torch.Tensor] = {}  # [T] bool
        self.family: dict[SeqId, int] = {}
        self.step = 0
        self.families = 0

    # ---------------------------------------------------------------- helpers

    def values(self, n: int) -> torch.Tensor:
        self.step += 1
        gen = torch.Generator().manual_seed(self.step)
        return torch.randn(n, 2, LAYERS, HEADS, DIM, generator=gen)

    def snapshot(self) -> tuple[object, ...]:
        tables = {s: self.pool.block_table(s) for s in self.pool.sequences()}
        refs = [self.pool.ref_count(p) for p in range(PAGES)]
        return tables, refs, self.pool.stats(), self.pool.evictable_pages(), self.pool.k.clone()

    def assert_unchanged(self, before: tuple[object, ...]) -> None:
        after = self.snapshot()
        assert before[:4] == after[:4]
        assert torch.equal(before[4], after[4])  # type: ignore[arg-type]

    def add(self, seq: SeqId, n: int, family: int | None = None) -> None:
        self.expected[seq] = torch.zeros(n, 2, LAYERS, HEADS, DIM)
        self.known[seq] = torch.zeros(n, dtype=torch.bool)
        if family is None:
            self.families += 1
            family = self.families
        self.family[seq] = family

    def drop(self, seq: SeqId) -> None:
        del self.expected[seq], self.known[seq], self.family[seq]

    def tail_needs_copy(self, seq: SeqId) -> bool:
        table = self.pool.block_table(seq)
        if table.num_tokens % PAGE == 0:
            return False
        tail = table.pages[-1]
        return self.pool.ref_count(tail) > 1 or self.pool.is_cached(tail)

    # ---------------------------------------------------------------- rules

    @rule(rid=st.sampled_from(REQUESTS), label=st.sampled_from(LABELS), n=st.integers(0, 14))
    def allocate(self, rid: str, label: str, n: int) -> None:
        seq = SeqId(rid, label)
        if seq in self.expected:
            with pytest.raises(SequenceExists):
                self.pool.allocate(seq, n)
            return
        need = -(-n // PAGE)
        if need > self.pool.pages_free + self.pool.pages_cached:
            before = self.snapshot()
            with pytest.raises(PoolExhausted):
                self.pool.allocate(seq, n)
            self.assert_unchanged(before)
            return
        self.pool.allocate(seq, n)
        self.add(seq, n)

    @rule(
        rid=st.sampled_from(REQUESTS),
        label=st.sampled_from(LABELS),
        prompt=st.sampled_from(PROMPTS),
        extra=st.sampled_from(EXTRAS),
        suffix=st.lists(st.integers(0, 3), max_size=5),
    )
    def allocate_with_prefix(
        self, rid: str, label: str, prompt: list[int], extra: str | None, suffix: list[int]
    ) -> None:
        seq, tokens = SeqId(rid, label), prompt + suffix
        if seq in self.expected:
            return
        before = self.snapshot()
        try:
            cached = self.pool.allocate_with_prefix(seq, tokens, extra)
        except PoolExhausted as e:
            assert e.needed > e.free
            self.assert_unchanged(before)
            return
        assert cached % PAGE == 0 and cached <= len(tokens) // PAGE * PAGE
        reference = fake_kv(tokens, extra)
        got = dense(self.pool, seq)
        assert torch.equal(got[:cached], reference[:cached])  # a hit reproduces the K/V
        write_all(self.pool, seq, reference[cached:], start=cached)
        self.pool.mark_computed(seq)
        self.add(seq, len(tokens))
        self.expected[seq] = reference.clone()
        self.known[seq][:] = True

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 6), fill=st.booleans())
    def append(self, data: st.DataObject, n: int, fill: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        start = self.pool.num_tokens(seq)
        need = int(self.tail_needs_copy(seq)) + self.pool.pages_for(start + n) - -(-start // PAGE)
        if need > self.pool.pages_available:
            before = self.snapshot()
            with pytest.raises(PoolExhausted) as info:
                self.pool.append(seq, n)
            assert (info.value.needed, info.value.free) == (need, self.pool.pages_available)
            self.assert_unchanged(before)
            return
        slots = self.pool.append(seq, n)
        assert slots == self.pool.slots(seq, start, start + n)
        for page in {s.page for s in slots}:  # new slots are private to seq
            assert self.pool.ref_count(page) == 1 and not self.pool.is_cached(page)
        self.expected[seq] = torch.cat([self.expected[seq], torch.zeros(n, 2, LAYERS, HEADS, DIM)])
        self.known[seq] = torch.cat([self.known[seq], torch.zeros(n, dtype=torch.bool)])
        if fill:
            self.write(seq, list(range(start, start + n)))

    @precondition(lambda self: any(self.known[s].numel() for s in self.known))
    @rule(data=st.data())
    def write_some(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in sorted(self.expected) if len(self.known[s])]))
        n = len(self.known[seq])
        positions = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6, unique=True))
        self.write(seq, positions)

    def write(self, seq: SeqId, positions: list[int]) -> None:
        values = self.values(len(positions))
        before = self.snapshot()
        try:
            for layer in range(LAYERS):
                self.pool.write(seq, layer, positions, values[:, 0, layer], values[:, 1, layer])
        except PoolExhausted:
            assert layer == 0  # copies happen on the first layer's write, or never
            self.assert_unchanged(before)
            return
        self.expected[seq][positions] = values
        self.known[seq][positions] = True

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), rid=st.sampled_from(REQUESTS), label=st.sampled_from(LABELS))
    def fork(self, data: st.DataObject, rid: str, label: str) -> None:
        src, dst = data.draw(st.sampled_from(sorted(self.expected))), SeqId(rid, label)
        if dst in self.expected:
            with pytest.raises(SequenceExists):
                self.pool.fork(src, dst)
            return
        self.pool.fork(src, dst)
        self.add(dst, 0, family=self.family[src])
        self.expected[dst] = self.expected[src].clone()
        self.known[dst] = self.known[src].clone()

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def copy_on_write(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        needed = self.tail_needs_copy(seq)
        if needed and self.pool.pages_available == 0:
            with pytest.raises(PoolExhausted):
                self.pool.copy_on_write(seq)
            return
        pairs = self.pool.copy_on_write(seq)
        assert len(pairs) == int(needed)
        for src, dst in pairs:
            assert pool_page_equal(self.pool, src, dst)
            assert self.pool.block_table(seq).pages[-1] == dst

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        """Valid at any time here: keyed pages come from prefill and are rewritten only after
        they were declared computed (which drops their keys)."""
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self.pool.mark_computed(seq)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self.pool.free(seq)
        self.drop(seq)

    @rule(rid=st.sampled_from(REQUESTS), preempt=st.booleans())
    def free_request(self, rid: str, preempt: bool) -> None:
        mine = [s for s in self.expected if s.request_id == rid]
        if preempt:
            tokens = self.pool.preempt(rid)
            assert tokens == {s.label: len(self.known[s]) for s in mine}
        else:
            assert self.pool.free_request(rid) == len(mine)
        for seq in mine:
            self.drop(seq)
        assert self.pool.pages_of(rid) == frozenset()

    # ---------------------------------------------------------------- invariants

    @invariant()
    def accounting(self) -> None:
        pool = self.pool
        assert pool.pages_in_use + pool.pages_free + pool.pages_cached == PAGES
        refs: dict[int, int] = {}
        for seq in pool.sequences():
            table = pool.block_table(seq)
            assert len(table.pages) == len(set(table.pages)) == pool.pages_for(table.num_tokens)
            for page in table.pages:
                refs[page] = refs.get(page, 0) + 1
        assert all(pool.ref_count(p) == refs.get(p, 0) for p in range(PAGES))
        assert pool.pages_in_use == len(refs)
        for page in pool.evictable_pages():
            assert pool.ref_count(page) == 0 and pool.is_cached(page)
        unreferenced = [p for p in range(PAGES) if p not in refs]
        assert len(unreferenced) == pool.pages_free + pool.pages_cached
        stats = pool.stats()
        assert stats.sequences == len(self.expected)
        assert stats.requests == len({s.request_id for s in self.expected})
        assert (pool.k.data_ptr(), pool.v.data_ptr()) == self.ptrs

    @invariant()
    def sharing_is_explained(self) -> None:
        """A page held by two fork families is a cached full page; a partial tail page is
        never cached, so it is shared only within one fork family."""
        holders: dict[int, set[int]] = {}
        for seq in self.pool.sequences():
            for page in self.pool.block_table(seq).pages:
                holders.setdefault(page, set()).add(self.family[seq])
            table = self.pool.block_table(seq)
            if table.num_tokens % PAGE:
                assert not self.pool.is_cached(table.pages[-1])
        for page, families in holders.items():
            if len(families) > 1:
                assert self.pool.is_cached(page)

    @invariant()
    def gather_returns_what_was_written(self) -> None:
        for seq, expected in self.expected.items():
            known = self.known[seq]
            assert self.pool.num_tokens(seq) == len(known)
            for layer in range(LAYERS):
                k, v = self.pool.gather(seq, layer)
                assert torch.equal(k[known], expected[known, 0, layer])
                assert torch.equal(v[known], expected[known, 1, layer])

    def teardown(self) -> None:
        for rid in REQUESTS:
            self.pool.free_request(rid)
        assert self.pool.pages_in_use == 0 and self.pool.sequences() == []
        assert self.pool.pages_free + self.pool.pages_cached == PAGES


def pool_page_equal(pool: KVPool, a: int, b: int) -> bool:
    return torch.equal(pool.k[:, a], pool.k[:, b]) and torch.equal(pool.v[:, a], pool.v[:, b])


KVPoolMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestKVPoolMachine = KVPoolMachine.TestCase


# ------------------------------------------------------------------------ device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_on_cuda_matches_cpu() -> None:
    pools = [make_pool(device="cpu"), make_pool(device="cuda")]
    tokens = list(range(11))
    for pool in pools:
        prefill(pool, A, tokens)
        pool.fork(A, B)
        pool.append(B, 2)
        write_all(pool, B, fake_kv(list(range(13)))[11:], start=11)
        assert prefill(pool, C, tokens) == 8
    for seq in (A, B, C):
        assert torch.equal(dense(pools[0], seq), dense(pools[1], seq).cpu())
    assert pools[0].stats() == pools[1].stats()
