"""Lowered per-node callables, run in dependency order over batches of 1, 3 and 8 requests of
mixed shapes, against the reference interpreter run per request.

Equality: integer outputs (tokens, codes) must be identical. Float outputs are compared as
``max|batched - reference| <= 1e-5 * max|reference|``, not bitwise: a batched matmul sums in
a different order than a batch-1 matmul (a single denoiser call on 4 stacked requests already
differs from 4 separate calls by ~7e-7), and 19 guided Euler steps carry that along. Batches of
one request call the component exactly as the interpreter does, and are checked bitwise."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve import capture
from walkserve.adapters.examples import EXAMPLES, build_example
from walkserve.capture import ir
from walkserve.lowering.batched import BatchedRunner, BatchStats
from walkserve.lowering.callables import build_callables
from walkserve.lowering.lower import batch_buckets, lower
from walkserve.lowering.plan import ExecutablePlan, NodePlan
from walkserve.lowering.split import split_block
from walkserve.testing import assert_outputs_match, mixed_requests

CACHE: dict[str, Any] = {}


def setup(name: str) -> tuple[capture.CapturedModel, dict[str, Any]]:
    if name not in CACHE:
        model, sample = build_example(name)
        CACHE[name] = (capture.trace(model, sample), sample)
    return CACHE[name]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(EXAMPLES))
@pytest.mark.parametrize("glue", ["fuse", "separate"])
def test_batched_plan_matches_interpreter(name: str, glue: str) -> None:
    captured, sample = setup(name)
    plan = lower(captured, sample, glue=glue, check_capture=False)
    stats = BatchStats()
    runner = BatchedRunner(captured, plan, build_callables(captured, plan, stats=stats))
    for n in (1, 3, 8):
        requests = mixed_requests(name, sample, n)
        for walk in captured.graph.entry_walks():
            got = runner.run(requests, walk)
            for g, r in zip(got, requests):
                assert_outputs_match(g, captured.run(r, walk), bitwise=n == 1)
    # Requests really shared calls (continuous batching across lengths and iterations).
    assert max(max(sizes) for sizes in stats.calls.values()) > 1


def test_padding_to_batch_buckets_changes_no_result() -> None:
    captured, sample = setup("example-world")
    plan = lower(captured, sample, check_capture=False, max_batch=8)
    plain = BatchedRunner(captured, plan, build_callables(captured, plan))
    padded = BatchedRunner(captured, plan, build_callables(captured, plan, pad_to_buckets=True))
    requests = mixed_requests("example-world", sample, 5)  # 5 -> bucket 8: three padding rows
    for a, b, r in zip(plain.run(requests), padded.run(requests), requests):
        assert_outputs_match(b, a, bitwise=False)
        assert_outputs_match(b, captured.run(r), bitwise=False)


def test_batch_dims_found_for_kv_caches() -> None:
    captured, sample = setup("example-text")
    plan = lower(captured, sample, check_capture=False)
    (lm,) = [n for n in plan.nodes("decode") if n.kind == "component"]
    # lm(token [B,1], k_cache [layers,B,H,T,hd], v_cache [...]) -> (logits [B,1,V], k, v)
    assert lm.in_dims == [0, 1, 1]
    assert lm.out_dim == [0, 1, 1]


def test_glue_policy_decides_fusion() -> None:
    captured, _ = setup("example-text")
    body = next(n for n in captured.walk("decode").body.nodes if isinstance(n, ir.LoopNode)).body
    fused = split_block(body, lambda op: True).nodes
    separate = split_block(body, lambda op: False).nodes
    assert (
        len(fused) == 1 and isinstance(fused[0], NodePlan) and len(fused[0].ops) == len(body.nodes)
    )
    assert [n.kind for n in separate if isinstance(n, NodePlan)] == ["component", "glue"]


def test_buckets_and_plan_round_trip() -> None:
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    captured, sample = setup("example-speech")
    plan = lower(captured, sample, check_capture=False)
    again = ExecutablePlan.from_json(plan.to_json())
    assert again == plan
    assert "decode_chunk/codec" in plan.format()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 6),
    rows=st.integers(1, 3),
    odd=st.sampled_from(["none", "shape", "dtype", "shared", "kwargs", "rows"]),
    at=st.integers(1, 5),
)
def test_calls_alike_run_as_the_general_grouping_runs_them(
    n: int, rows: int, odd: str, at: int
) -> None:
    """``BatchedComponent``'s fast path (every call alike: one group, no signature per call)
    gives what the general grouping gives, outputs and batch sizes both; a call that is not
    alike (another shape, dtype, shared argument, keywords or rows) takes the general path."""
    import torch

    from walkserve.lowering.batched import BatchedComponent

    def fn(x: torch.Tensor, scale: torch.Tensor, k: int = 1) -> torch.Tensor:
        return x.float() * scale + k

    scale = torch.tensor(2.0)
    calls: list[Any] = [([torch.full((rows, 3), float(i)), scale], {}) for i in range(n)]
    k = min(at, n - 1)
    x = calls[k][0][0]
    if odd == "shape":
        calls[k] = ([torch.zeros(rows, 4), scale], {})
    elif odd == "dtype":
        calls[k] = ([x.double(), scale], {})
    elif odd == "shared":
        calls[k] = ([x, torch.tensor(2.0)], {})  # equal by value: the general path groups it
    elif odd == "kwargs":
        calls[k] = ([x, scale], {"k": 1})
    elif odd == "rows":
        calls[k] = ([torch.ones(rows + 1, 3), scale], {})
    fast, slow = BatchStats(), BatchStats()
    component = BatchedComponent("c", fn, [0, None], {"k": None}, 0, stats=fast)
    general = BatchedComponent("c", fn, [0, None], {"k": None}, 0, stats=slow)
    general._alike = lambda batch: 0  # type: ignore[method-assign]
    got, want = component(calls), general(calls)
    assert len(got) == len(want) == n
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert fast.calls == slow.calls
    assert (component._alike(calls) > 0) == (odd == "none")


def test_direct_is_the_function_only_where_joined_adds_nothing() -> None:
    """The fast lane calls ``BatchedComponent.direct()`` in place of ``joined`` per step: the
    component's own function where ``joined`` would add nothing, else None (batch buckets to
    pad to, stats to count, or a subclass's ``joined``, as CUDA graphs' replays), and where it
    is the function, ``joined`` gives what it gives."""
    import torch

    from walkserve.lowering.batched import BatchedComponent
    from walkserve.lowering.cudagraph import GraphOnFirstCall

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    plain = BatchedComponent("c", fn, [0], {}, 0)
    assert plain.direct() is fn
    call = ([torch.arange(6.0).reshape(3, 2)], {})
    assert torch.equal(plain.joined(call, 3), fn(*call[0]))
    assert BatchedComponent("c", fn, [0], {}, 0, buckets=[1, 2, 4]).direct() is None
    assert BatchedComponent("c", fn, [0], {}, 0, stats=BatchStats()).direct() is None
    graphs = GraphOnFirstCall("c", fn, [0], {}, 0, graph_buckets=[1, 2])
    assert graphs.direct() is None
