"""``TorchPagedAttention``, ``write_kv`` and ``DoubleBufferedPlanner`` on CPU.

Every result is checked against a dense reference written plainly below: per sequence, its full
K/V concatenated in position order, an explicit loop over queries and heads, softmax over the
positions the query may see (soft-capped logits, a sink logit per head, when asked). Batches mix
prefill (no context), chunked prefill (context and several queries) and decode (one query), with
random page sizes, shuffled page ids, value heads that may be smaller than key heads, and
sliding-window sequences whose leading pages were freed (block tables from ``first_page``); pool
slots no sequence owns hold NaN, so reading one shows up (the unfilled tail of a sequence's last
page is zero, as ``KVPool`` hands pages out, and masked).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.kv.attention import (
    AttentionConfig,
    AttentionMetadata,
    ScoreParams,
    SequenceSpec,
    write_kv,
)
from walkserve.runtime.kv.planner import DoubleBufferedPlanner
from walkserve.runtime.kv.torch_attention import TorchPagedAttention, TorchPlan

FAST = settings(max_examples=80, deadline=None)
ATOL = 1e-5


# --- the dense reference and a pool filled by hand ------------------------------------------


def dense_attention(
    config: AttentionConfig,
    context_len: int,
    q: torch.Tensor,  # [query_len, H, D]
    k: torch.Tensor,  # [seq_len, KVH, D], position order
    v: torch.Tensor,  # [seq_len, KVH, Dv]
    scores: ScoreParams | None = None,
) -> torch.Tensor:  # [query_len, H, Dv]
    """Float64, one query and one head at a time."""
    params = scores or ScoreParams.of(config)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    group = config.num_heads // config.num_kv_heads
    for i in range(q.shape[0]):
        p = context_len + i
        lo = 0 if config.sliding_window is None else max(0, p - config.sliding_window + 1)
        for h in range(config.num_heads):
            keys = k[lo : p + 1, h // group].double()  # [n, D]
            vals = v[lo : p + 1, h // group].double()
            logits = keys @ q[i, h].double() * params.scale
            if params.softcap is not None:
                logits = torch.tanh(logits / params.softcap) * params.softcap
            if params.sinks is not None:
                logits = torch.cat([logits, params.sinks[h : h + 1].double()])
            weights = torch.softmax(logits, dim=0)[: len(vals)]  # a sink's share is dropped
            out[i, h] = weights @ vals
    return out


@dataclass
class Batch:
    config: AttentionConfig
    specs: list[SequenceSpec]
    q: list[torch.Tensor]  # per sequence [query_len, H, D]
    k: list[torch.Tensor]  # per sequence [seq_len, KVH, D]
    v: list[torch.Tensor]
    num_pages: int
    scores: ScoreParams | None = None


def freed_pages(config: AttentionConfig, context_len: int) -> int:
    """Leading pages a window no longer reaches from position ``context_len`` on (what
    ``GroupedKVPool`` frees); 0 without a window."""
    if config.sliding_window is None:
        return 0
    return max(0, context_len - config.sliding_window + 1) // config.page_size


def make_batch(
    config: AttentionConfig,
    shapes: Sequence[tuple[int, int]],  # (context_len, query_len) per sequence
    page_order: Sequence[int],
    spare_pages: int = 0,
    seed: int = 0,
    scores: ScoreParams | None = None,
    freed: bool = False,
) -> Batch:
    """Give sequence after sequence the next pages of ``page_order`` (plus ``spare_pages``
    reserved but unused entries each) and random Q/K/V; with ``freed``, the leading pages its
    window no longer reaches are left out (``first_page``)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    specs, qs, ks, vs, taken = [], [], [], [], 0
    for context_len, query_len in shapes:
        first = freed_pages(c, context_len) if freed else 0
        n = -(-(context_len + query_len) // c.page_size) - first + spare_pages
        table = tuple(page_order[taken : taken + n])
        specs.append(SequenceSpec(table, context_len, query_len, first))
        taken += n
        seq_len = context_len + query_len
        qs.append(torch.randn(query_len, c.num_heads, c.head_dim, generator=g))
        ks.append(torch.randn(seq_len, c.num_kv_heads, c.head_dim, generator=g))
        vs.append(torch.randn(seq_len, c.num_kv_heads, c.value_dim, generator=g))
    assert taken <= len(page_order)
    return Batch(config, specs, qs, ks, vs, len(page_order), scores)


def new_pool(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of NaN with each sequence's *context* written position by position; the pages a
    sequence holds are zero where nothing was written yet (``KVPool`` zeroes every page it
    hands out), so a read of a slot outside the sequence's pages shows up as NaN."""
    c = batch.config
    shape = (batch.num_pages, c.page_size, c.num_kv_heads, c.head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full((*shape[:3], c.value_dim), float("nan"))
    for spec in batch.specs:
        held = list(spec.block_table)  # every page of its block table
        k_cache[held] = 0.0
        v_cache[held] = 0.0
    for spec, k, v in zip(batch.specs, batch.k, batch.v):
        for p in range(spec.first_page * c.page_size, spec.context_len):
            page = spec.block_table[p // c.page_size - spec.first_page]
            offset = p % c.page_size
            k_cache[page, offset] = k[p]
            v_cache[page, offset] = v[p]
    return k_cache, v_cache


def run_step(
    backend: TorchPagedAttention,
    batch: Batch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata[TorchPlan],
) -> torch.Tensor:
    """What a model layer does: write the new tokens' K/V, then attend."""
    new_k = torch.cat([k[s.context_len :] for s, k in zip(batch.specs, batch.k)])
    new_v = torch.cat([v[s.context_len :] for s, v in zip(batch.specs, batch.v)])
    write_kv(k_cache, v_cache, metadata.slot_mapping, new_k, new_v)
    return backend.run(torch.cat(batch.q), k_cache, v_cache, metadata, batch.scores)


def check_against_dense(batch: Batch, out: torch.Tensor) -> None:
    row = 0
    for spec, q, k, v in zip(batch.specs, batch.q, batch.k, batch.v):
        want = dense_attention(batch.config, spec.context_len, q, k, v, batch.scores)
        got = out[row : row + spec.query_len].double()
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (spec, (got - want).abs().max())
        row += spec.query_len
    assert row == out.shape[0]


def check_batch(batch: Batch) -> None:
    backend = TorchPagedAttention(batch.config)
    k_cache, v_cache = new_pool(batch)
    out = run_step(backend, batch, k_cache, v_cache, backend.plan(batch.specs))
    check_against_dense(batch, out)


# --- random batches -------------------------------------------------------------------------

decode = st.tuples(st.integers(0, 24), st.just(1))
prefill = st.tuples(st.just(0), st.integers(2, 12))
chunked = st.tuples(st.integers(1, 24), st.integers(2, 8))


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    config = AttentionConfig(
        num_kv_heads=(kv := draw(st.sampled_from([1, 2]))),
        num_heads=(heads := kv * draw(st.sampled_from([1, 2, 4]))),
        head_dim=draw(st.sampled_from([4, 8])),
        page_size=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16])),
        sliding_window=draw(st.none() | st.integers(1, 12)),
        scale=draw(st.none() | st.floats(0.05, 1.0)),
        v_head_dim=draw(st.none() | st.sampled_from([3, 6])),
    )
    scores = None
    if draw(st.booleans()):  # a soft cap and/or sinks: the explicit softmax path
        softcap = draw(st.none() | st.floats(0.5, 5.0))
        sink_seed = draw(st.none() | st.integers(0, 99))
        sinks = None
        if sink_seed is not None:
            sinks = torch.randn(heads, generator=torch.Generator().manual_seed(sink_seed))
        scores = ScoreParams(config.softmax_scale, softcap, sinks)
    shapes = draw(st.lists(st.one_of(decode, prefill, chunked), min_size=1, max_size=5))
    spare = draw(st.integers(0, 1))
    needed = sum(-(-(c + q) // config.page_size) + spare for c, q in shapes)
    pages = draw(st.permutations(range(needed + draw(st.integers(0, 3)))))
    seed = draw(st.integers(0, 2**31))
    return make_batch(config, shapes, pages, spare, seed, scores, freed=draw(st.booleans()))


@FAST
@given(batches())
def test_random_batches_match_dense_reference(batch: Batch) -> None:
    check_batch(batch)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 3, 100])
@pytest.mark.parametrize("page_size", [1, 4, 7])
def test_prefill_chunked_prefill_and_decode_in_one_batch(
    group: int, window: int | None, page_size: int
) -> None:
    config = AttentionConfig(
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=8,
        page_size=page_size,
        sliding_window=window,
    )
    shapes = [(0, 9), (5, 1), (11, 4), (0, 1), (20, 1)]  # prefill, decode, chunked, ...
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(page_size)).tolist()
    check_batch(make_batch(config, shapes, pages, spare_pages=1, seed=group))


def test_decode_sequences_are_padded_without_reading_padding() -> None:
    """Decode lengths 1, 2 and 17 in one group: the short ones are padded to 17 and masked."""
    config = AttentionConfig(num_heads=4, num_kv_heads=1, head_dim=8, page_size=4)
    check_batch(make_batch(config, [(0, 1), (1, 1), (16, 1)], list(range(12))[::-1]))


def test_window_one_attends_only_to_itself() -> None:
    config = AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=4, page_size=2, sliding_window=1)
    batch = make_batch(config, [(3, 4), (6, 1)], list(range(8)))
    backend = TorchPagedAttention(config)
    k_cache, v_cache = new_pool(batch)
    out = run_step(backend, batch, k_cache, v_cache, backend.plan(batch.specs))
    assert torch.allclose(out[:4], batch.v[0][3:], atol=ATOL)  # softmax over one key: v itself
    assert torch.allclose(out[4], batch.v[1][6], atol=ATOL)


def test_chunked_prefill_equals_whole_prefill() -> None:
    """Prefilling 12 tokens at once, or as chunks of 5, 4 and 3 after each other, gives the
    same outputs: the chunk's causal mask is offset by its context."""
    config = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, page_size=3)
    whole = make_batch(config, [(0, 12)], [2, 0, 3, 1], seed=7)
    backend = TorchPagedAttention(config)
    k_cache, v_cache = new_pool(whole)
    expected = run_step(backend, whole, k_cache, v_cache, backend.plan(whole.specs))
    k_cache, v_cache = new_pool(whole)
    table, got = whole.specs[0].block_table, []
    for start, n in [(0, 5), (5, 4), (9, 3)]:
        chunk = Batch(
            config,
            [SequenceSpec(table, start, n)],
            [whole.q[0][start : start + n]],
            [whole.k[0][: start + n]],
            [whole.v[0][: start + n]],
            whole.num_pages,
        )
        got.append(run_step(backend, chunk, k_cache, v_cache, backend.plan(chunk.specs)))
    assert torch.allclose(torch.cat(got), expected, atol=ATOL)


@pytest.mark.parametrize("decode_only", [False, True])
def test_soft_cap_sinks_and_smaller_value_heads(decode_only: bool) -> None:
    """Gemma 2's soft cap with a non-default scale, gpt-oss sinks and DeepSeek's value heads
    smaller than its key heads, in one batch, against the dense reference."""
    config = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, scale=0.3, v_head_dim=5
    )
    shapes = [(0, 1), (7, 1), (30, 1)] if decode_only else [(0, 9), (7, 1), (12, 5)]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    batch = make_batch(config, shapes, list(range(40))[::-1], scores=ScoreParams(0.3, 1.2, sinks))
    check_batch(batch)
    # the test can fail: the same batch without the soft cap is far from the reference
    backend = TorchPagedAttention(config)
    k_cache, v_cache = new_pool(batch)
    plain = Batch(config, batch.specs, batch.q, batch.k, batch.v, batch.num_pages)
    out = run_step(backend, plain, k_cache, v_cache, backend.plan(batch.specs))
    with pytest.raises(AssertionError):
        check_against_dense(batch, out)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_freed_leading_pages_are_never_read(window: int) -> None:
    """Sequences whose pages before ``first_page`` are gone (their slots hold NaN in the pool):
    decode and chunked prefill far past the window read only live pages."""
    config = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, sliding_window=window
    )
    shapes = [(40, 1), (23, 1), (17, 6), (0, 5)]
    batch = make_batch(config, shapes, list(range(60)), seed=window, freed=True)
    assert [s.first_page for s in batch.specs][:3] == [
        freed_pages(config, c) for c, _ in shapes[:3]
    ]
    assert batch.specs[0].first_page > 0
    check_batch(batch)


def test_a_query_reading_a_freed_page_is_refused() -> None:
    config = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=4, page_size=4, sliding_window=4)
    backend = TorchPagedAttention(config)
    backend.plan([SequenceSpec((5, 6), 9, 1, first_page=1)])  # query 9 sees 6..9: page 1 on
    with pytest.raises(ValueError, match="still reads them"):
        backend.plan([SequenceSpec((5, 6, 7), 9, 1, first_page=2)])
    no_window = TorchPagedAttention(replace(config, sliding_window=None))
    with pytest.raises(ValueError, match="still reads them"):
        no_window.plan([SequenceSpec((5, 6), 9, 1, first_page=1)])


# --- metadata, write_kv, validation ---------------------------------------------------------


def test_metadata_index_math() -> None:
    """The module docstring's picture: page_size 4, a = [3, 1] with 4 cached + 3 new tokens,
    b = [2, 4] with 4 cached + 1 new, c = [0, 5] prefill of 5."""
    config = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=4, page_size=4)
    specs = [SequenceSpec((3, 1), 4, 3), SequenceSpec((2, 4, 6), 4, 1), SequenceSpec((0, 5), 0, 5)]
    meta = TorchPagedAttention(config).plan(specs)
    assert meta.query_start.tolist() == [0, 3, 4, 9]
    assert meta.query_len.tolist() == [3, 1, 5]
    assert meta.context_len.tolist() == [4, 4, 0]
    assert meta.num_pages.tolist() == [2, 2, 2]  # b's third page is reserved, not read
    assert meta.block_tables.tolist() == [[3, 1], [2, 4], [0, 5]]
    # a: positions 4, 5, 6 -> page 1 offsets 0-2; b: position 4 -> page 4; c: 0-3 page 0, 4 page 5
    assert meta.slot_mapping.tolist() == [4, 5, 6, 16, 0, 1, 2, 3, 20]
    assert meta.total_query_tokens == 9 and meta.batch_size == 3
    assert meta.max_page_id == 5
    assert meta.scale == pytest.approx(0.5) and meta.num_kv_heads == 1
    assert meta.sliding_window is None


def test_write_kv_puts_tokens_at_their_slots() -> None:
    k_cache, v_cache = torch.zeros(3, 2, 1, 2), torch.zeros(3, 2, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, torch.tensor([5, 0, 2]), k, -k)
    assert k_cache[2, 1, 0].tolist() == [0.0, 1.0]  # slot 5 = page 2, offset 1
    assert k_cache[0, 0, 0].tolist() == [2.0, 3.0]
    assert v_cache[1, 0, 0].tolist() == [-4.0, -5.0]  # slot 2 = page 1, offset 0
    assert k_cache[0, 1].abs().sum() == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"scale": -1.0}, "scale"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, int | float], message: str) -> None:
    base: dict[str, int | float] = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**{**base, "page_size": 4, **kwargs})  # type: ignore[arg-type]


def test_plan_and_run_reject_bad_batches() -> None:
    config = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=4, page_size=4)
    backend = TorchPagedAttention(config)
    with pytest.raises(ValueError, match="query_len"):
        SequenceSpec((0,), 0, 0)
    with pytest.raises(ValueError, match="need 2 pages"):
        backend.plan([SequenceSpec((0,), 3, 2)])
    with pytest.raises(ValueError, match="at least one sequence"):
        backend.plan([])
    meta = backend.plan([SequenceSpec((7,), 0, 2)])
    cache = torch.zeros(4, 4, 1, 4)
    with pytest.raises(ValueError, match="reads page 7"):
        backend.run(torch.zeros(2, 2, 4), cache, cache, meta)
    with pytest.raises(ValueError, match="q has shape"):
        backend.run(torch.zeros(3, 2, 4), torch.zeros(8, 4, 1, 4), torch.zeros(8, 4, 1, 4), meta)


# --- double-buffered planning ---------------------------------------------------------------


def snapshot(meta: AttentionMetadata[TorchPlan]) -> list[torch.Tensor]:
    plan = meta.prepared
    tensors = [meta.query_start, meta.context_len, meta.block_tables, meta.slot_mapping]
    if plan.decode is not None:
        tensors += [plan.decode.rows, plan.decode.pages, plan.decode.mask]
    for piece in plan.prefills:
        tensors += [piece.pages, piece.mask]
    return [t.clone() for t in tensors]


def test_planner_pipeline_matches_reference_step_by_step() -> None:
    """Six steps of a batch that starts with two prefills and a decode and then decodes; step
    N+1 is planned on the planning thread before step N runs. Each step's metadata is unchanged
    by the next plan, slots alternate, and every output matches the dense reference."""
    config = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, page_size=3, sliding_window=5)
    steps, total = 6, [9, 14, 8]  # final lengths
    pages = torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()
    full = make_batch(config, [(0, n) for n in total], pages, seed=11)  # per-position data
    tables = [s.block_table for s in full.specs]
    schedule = [[(0, 4), (0, 9), (2, 1)]]  # step 0: prefill 4, prefill 9, decode (2 cached)
    for _ in range(steps - 1):
        schedule.append([(c + q, 1) for c, q in schedule[-1]])

    def step_batch(shapes: list[tuple[int, int]]) -> Batch:
        return Batch(
            config,
            [SequenceSpec(t, c, q) for t, (c, q) in zip(tables, shapes)],
            [x[c : c + q] for x, (c, q) in zip(full.q, shapes)],
            [x[: c + q] for x, (c, q) in zip(full.k, shapes)],
            [x[: c + q] for x, (c, q) in zip(full.v, shapes)],
            full.num_pages,
        )

    first = step_batch(schedule[0])
    k_cache, v_cache = new_pool(first)  # the third sequence's 2 cached tokens
    backend = TorchPagedAttention(config)
    slots = []
    with DoubleBufferedPlanner(backend) as planner:
        planner.submit(first.specs)
        for n in range(steps):
            meta = planner.take()
            slots.append(meta.slot)
            before = snapshot(meta)
            if n + 1 < steps:
                planner.submit(step_batch(schedule[n + 1]).specs)
            out = run_step(backend, step_batch(schedule[n]), k_cache, v_cache, meta)
            check_against_dense(step_batch(schedule[n]), out)
            assert all(torch.equal(a, b) for a, b in zip(before, snapshot(meta)))
            assert planner.buffer(meta.slot) is meta
    assert slots == [0, 1, 0, 1, 0, 1]


class InPlaceBackend:
    """A backend that, like FlashInfer's wrappers, keeps per-slot state and overwrites it in
    place on every plan. Its plan blocks until the test lets it finish, so the test can look at
    the in-use slot while the next plan is half done on the planning thread."""

    def __init__(self, config: AttentionConfig) -> None:
        self.config = config
        self.device = torch.device("cpu")
        self.inner = TorchPagedAttention(config)
        self.state = [torch.full((8,), -1, dtype=torch.int64) for _ in range(2)]
        self.plan_started = threading.Event()
        self.may_finish = threading.Event()
        self.plan_threads: list[str] = []

    def plan(self, batch: Sequence[SequenceSpec], slot: int = 0) -> AttentionMetadata[TorchPlan]:
        self.plan_threads.append(threading.current_thread().name)
        meta = self.inner.plan(batch, slot)
        self.state[slot][: len(batch)] = torch.tensor([s.context_len for s in batch])
        self.plan_started.set()
        assert self.may_finish.wait(timeout=10), "the test never let the plan finish"
        self.state[slot][len(batch) :] = 1000 + slot  # the rest of the in-place rewrite
        return meta

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata[TorchPlan],
    ) -> torch.Tensor:
        return self.inner.run(q, k_cache, v_cache, metadata)


def test_planning_next_step_never_touches_the_slot_in_use() -> None:
    config = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=4, page_size=2)
    backend = InPlaceBackend(config)
    with DoubleBufferedPlanner(backend) as planner:
        for step in range(4):
            backend.may_finish.clear()
            backend.plan_started.clear()
            planner.submit([SequenceSpec((0, 1, 2, 3, 4, 5, 6), step, 1)])  # returns at once
            assert backend.plan_started.wait(timeout=10)
            if step > 0:  # step - 1 "runs" now, while plan `step` is half done
                in_use = planner.in_use
                assert in_use is not None
                assert backend.state[in_use][0] == step - 1
                assert backend.state[in_use][1] == 1000 + in_use
            backend.may_finish.set()
            meta = planner.take()
            assert meta.slot == step % 2 and planner.in_use == meta.slot
            assert int(meta.context_len[0]) == step
    assert backend.plan_threads and all(
        name.startswith("attention-plan") for name in backend.plan_threads
    )


def test_planner_misuse_and_failed_plans() -> None:
    config = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=4, page_size=2)
    with DoubleBufferedPlanner(TorchPagedAttention(config)) as planner:
        with pytest.raises(RuntimeError, match="no plan pending"):
            planner.take()
        planner.submit([SequenceSpec((0,), 0, 1)])
        with pytest.raises(RuntimeError, match="already pending"):
            planner.submit([SequenceSpec((0,), 0, 1)])
        assert planner.take().slot == 0
        planner.submit([SequenceSpec((1,), 2, 1)])  # 3 tokens need 2 pages: plan fails
        with pytest.raises(ValueError, match="block table"):
            planner.take()
        assert planner.in_use == 0
        planner.submit([SequenceSpec((1,), 1, 1)])
        assert planner.take().slot == 1


def test_flashinfer_backend_is_lazy_and_refuses_non_cuda_devices() -> None:
    import sys

    from walkserve.runtime.kv.flashinfer_backend import (
        FlashInferPagedAttention,
        FlashInferUnavailable,
    )

    assert "flashinfer" not in sys.modules  # importing the backend module imports no kernels
    config = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=64, page_size=16)
    with pytest.raises(FlashInferUnavailable, match="only on CUDA"):
        FlashInferPagedAttention(config, "cpu", torch.float16)
    with pytest.raises(ValueError, match="supports"):
        FlashInferPagedAttention(config, "cpu", torch.float32)
