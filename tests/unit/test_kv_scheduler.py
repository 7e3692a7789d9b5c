"""The continuous-batching scheduler alone: no model, fabricated tokens."""

from __future__ import annotations

import torch

from walkserve.runtime.kv.pool import KVPool
from walkserve.runtime.kv.scheduler import ContinuousScheduler, StepPlan


def pool(num_pages: int, page_size: int = 4) -> KVPool:
    return KVPool(num_pages, page_size, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)


def fake_token(request_id: str, position: int) -> int:
    """A deterministic 'model': the next token depends only on the request and position."""
    return 100 + (sum(map(ord, request_id)) * 7 + position) % 50


def check(plan: StepPlan, kv: KVPool, budget: int) -> None:
    assert plan.num_tokens <= budget
    assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
    for c in plan.chunks:
        assert len(c.token_ids) == c.end - c.start > 0
        assert len(kv.block_table(c.seq).pages) >= kv.pages_for(c.end)


def drive(sched: ContinuousScheduler, kv: KVPool, budget: int) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not sched.has_work():
            return outputs
        plan = sched.schedule()
        check(plan, kv, budget)
        sampled = {c.request_id: fake_token(c.request_id, c.end) for c in plan.chunks if c.samples}
        for request_id, token in sched.update(plan, sampled).items():
            outputs.setdefault(request_id, []).append(token)
    raise AssertionError("the scheduler did not finish")


def expected(request_id: str, prompt_len: int, n: int) -> list[int]:
    return [fake_token(request_id, prompt_len + i) for i in range(n)]


def test_all_requests_finish_with_their_own_tokens_and_free_the_pool() -> None:
    kv = pool(64)
    sched = ContinuousScheduler(kv, max_batch_tokens=16)
    lengths = [(1, 3), (9, 1), (17, 12), (30, 5), (5, 20)]
    for i, (p, n) in enumerate(lengths):
        sched.add(f"r{i}", list(range(p)), n, eos=[])
    out = drive(sched, kv, 16)
    for i, (p, n) in enumerate(lengths):
        assert out[f"r{i}"] == expected(f"r{i}", p, n)
    assert kv.pages_in_use == 0
    assert sched.stats().finished == len(lengths)


def test_small_pool_preempts_and_recomputes_the_same_tokens() -> None:
    kv = pool(12)
    sched = ContinuousScheduler(kv, max_batch_tokens=32)
    for i in range(6):
        sched.add(f"r{i}", list(range(10 + i)), 20, eos=[])
    out = drive(sched, kv, 32)
    assert sched.stats().preemptions > 0
    for i in range(6):
        assert out[f"r{i}"] == expected(f"r{i}", 10 + i, 20)
    assert kv.pages_in_use == 0


def test_eos_finishes_early() -> None:
    kv = pool(16)
    sched = ContinuousScheduler(kv, max_batch_tokens=8)
    eos = fake_token("a", 5 + 2)  # the third new token
    sched.add("a", list(range(5)), 50, eos=[eos])
    assert drive(sched, kv, 8)["a"] == expected("a", 5, 3)


def test_prefix_pages_are_shared() -> None:
    kv = pool(32)
    sched = ContinuousScheduler(kv, max_batch_tokens=64)
    shared = list(range(20, 40))  # five full pages
    sched.add("a", [*shared, 1, 2], 2, eos=[])
    drive(sched, kv, 64)
    sched.add("b", [*shared, 3], 2, eos=[])
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.start == 20 and kv.stats().prefix_hits == 5


def test_cancel_waiting_and_running() -> None:
    kv = pool(16)
    sched = ContinuousScheduler(kv, max_batch_tokens=4)
    sched.add("a", list(range(10)), 5, eos=[])
    sched.add("b", list(range(10)), 5, eos=[])
    sched.update(sched.schedule(), {})
    assert sched.cancel("a") and sched.cancel("b")
    assert not sched.cancel("a")
    assert kv.pages_in_use == 0 and not sched.has_work()
