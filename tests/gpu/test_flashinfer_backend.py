"""On a CUDA machine: ``FlashInferPagedAttention`` against its twin ``TorchPagedAttention``, in
float16 and bfloat16, on batches that mix prefill, chunked prefill and decode, with GQA ratios
1/2/4, sliding windows, page sizes 1 and 16 and shuffled page ids; also the double-buffered
pipeline, and the Torch backend on CUDA against itself on CPU. Also (written without a GPU, not
yet run: see the backend's UNVERIFIED note) logit soft-capping, attention sinks, sequences whose
leading pages a sliding window freed, and value heads smaller than key heads. Skipped without
CUDA; the FlashInfer tests are also skipped without the ``flashinfer`` package (the ``gpu``
extra).

Reference: ``TorchPagedAttention`` on the same GPU in float32, fed exactly the float16/bfloat16
values FlashInfer reads (q and the caches upcast), so the reference adds no rounding beyond
float32's.

Tolerance, per output element: ``|flashinfer - reference| <= 4 * eps * max|v|``, with ``eps``
the dtype's machine epsilon (bfloat16 2**-7, float16 2**-10) and ``max|v|`` over the values the
batch reads. Why: an output is a convex combination of values, so |o| <= max|v|. FlashInfer
forms q.k in float32 from the same inputs and runs the softmax in float32; it rounds to the
dtype (1) the probabilities before the P.V product (relative error <= eps/2 each, at most
eps/2 * max|v| on o), (2) the output (<= eps/2 * max|v|), and (3) possibly the query pre-scaled
by the softmax scale, which perturbs a logit l by <= eps/2 * |l| and a probability by a factor
exp(+-eps * max|l|) ~ 1 +- eps * max|l|, with |l| <~ 4 for these random draws (<= 2 eps *
max|v| more once weights renormalise). Sum ~3 eps * max|v|; 4 leaves room for float32
accumulation order. For max|v| ~ 4.5 that is ~0.14 (bfloat16) and ~0.018 (float16).

Measured on one H200 (FlashInfer 0.7.4, torch 2.11 + CUDA 13.0): max errors 0.0035-0.009
(bfloat16) and 0.0004-0.0011 (float16), at most 7% of the tolerance. A window off by one
(``window_left = W``) errs 17-38x the bfloat16 tolerance at W = 1 and 3, hence window 1 here.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from walkserve.runtime.kv.attention import (
    AttentionConfig,
    ScoreParams,
    SequenceSpec,
    sequence_slots,
    write_kv,
)
from walkserve.runtime.kv.planner import DoubleBufferedPlanner
from walkserve.runtime.kv.torch_attention import TorchPagedAttention

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from walkserve.runtime.kv.flashinfer_backend import FlashInferPagedAttention

needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="needs the flashinfer package: pip install 'walkserve[gpu]'",
)
pytestmark = pytest.mark.gpu

HEAD_DIM = 128  # a head size FlashInfer compiles for
MIXED = [(0, 37), (100, 1), (57, 19), (0, 1), (300, 1), (16, 16)]  # (context_len, query_len)
DECODE = [(0, 1), (15, 1), (16, 1), (200, 1), (1000, 1)]


def make_batch(
    config: AttentionConfig,
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    seed: int,
    freed: bool = False,
) -> tuple[list[SequenceSpec], torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Specs over shuffled pages, a pool of random values (context and garbage alike), the new
    tokens' K ``[T, kv_heads, D]`` and V ``[T, kv_heads, Dv]`` and q ``[T, heads, D]``, all on
    CUDA in ``dtype``. ``freed``: each sequence's leading pages that its window no longer
    reaches are left out of its block table (``first_page``), as ``GroupedKVPool`` frees them."""
    g = torch.Generator().manual_seed(seed)
    ps, window = config.page_size, config.sliding_window
    firsts = [
        max(0, c - window + 1) // ps if freed and window is not None else 0 for c, _ in shapes
    ]
    needed = [-(-(c + q) // ps) - f for (c, q), f in zip(shapes, firsts)]
    pages = torch.randperm(sum(needed) + 7, generator=g).tolist()
    specs, taken = [], 0
    for (context_len, query_len), n, first in zip(shapes, needed, firsts):
        table = tuple(pages[taken : taken + n])
        specs.append(SequenceSpec(table, context_len, query_len, first))
        taken += n
    total = sum(q for _, q in shapes)
    heads, dk, dv = config.num_kv_heads, config.head_dim, config.value_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to("cuda", dtype)

    new_kv = (rand(total, heads, dk), rand(total, heads, dv))
    k_cache, v_cache = rand(len(pages), ps, heads, dk), rand(len(pages), ps, heads, dv)
    q = rand(total, config.num_heads, dk)
    return specs, q, k_cache, v_cache, new_kv


def reference(
    config: AttentionConfig,
    specs: list[SequenceSpec],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scores: ScoreParams | None = None,
) -> torch.Tensor:
    backend = TorchPagedAttention(config, "cuda")
    meta = backend.plan(specs)
    return backend.run(q.float(), k_cache.float(), v_cache.float(), meta, scores)


def tolerance(config: AttentionConfig, specs: list[SequenceSpec], v_cache: torch.Tensor) -> float:
    ps = config.page_size
    slots = torch.cat([sequence_slots(s, ps, s.first_page * ps) for s in specs]).cuda()
    max_v = v_cache.view(-1, config.num_kv_heads, config.value_dim)[slots].abs().max().item()
    return 4 * torch.finfo(v_cache.dtype).eps * max_v


def check_step(
    backend: FlashInferPagedAttention,
    specs: list[SequenceSpec],
    meta_slot: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new_kv: tuple[torch.Tensor, ...],
    scores: ScoreParams | None = None,
) -> str:
    """Plan, write the new K/V at the plan's slots, run, compare; returns the wrapper kind."""
    meta = backend.plan(specs, meta_slot)
    write_kv(k_cache, v_cache, meta.slot_mapping, new_kv[0], new_kv[1])
    got = backend.run(q, k_cache, v_cache, meta, scores).float()
    want = reference(backend.config, specs, q, k_cache, v_cache, scores)
    err = (got - want).abs().max().item()
    tol = tolerance(backend.config, specs, v_cache)
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    return meta.prepared.kind


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 1, 33], ids=["full", "window1", "window33"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [16, 1])
def test_mixed_batch_matches_torch(
    dtype: torch.dtype, window: int | None, group: int, page_size: int
) -> None:
    config = AttentionConfig(
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        page_size=page_size,
        sliding_window=window,
    )
    backend = FlashInferPagedAttention(config, "cuda", dtype)
    specs, q, k_cache, v_cache, new_kv = make_batch(config, MIXED, dtype, seed=group)
    assert check_step(backend, specs, 0, q, k_cache, v_cache, new_kv) == "prefill"


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 1, 33], ids=["full", "window1", "window33"])
def test_decode_batch_uses_the_decode_wrapper(dtype: torch.dtype, window: int | None) -> None:
    config = AttentionConfig(
        num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, sliding_window=window
    )
    backend = FlashInferPagedAttention(config, "cuda", dtype)
    specs, q, k_cache, v_cache, new_kv = make_batch(config, DECODE, dtype, seed=5)
    assert check_step(backend, specs, 1, q, k_cache, v_cache, new_kv) == "decode"


@needs_flashinfer
@pytest.mark.parametrize("shapes", [MIXED, DECODE], ids=["mixed", "decode"])
def test_soft_cap_scale_and_sinks_match_torch(shapes: list[tuple[int, int]]) -> None:
    """UNVERIFIED until run on a GPU: Gemma 2's soft cap with a non-default scale, and gpt-oss
    sinks, in the decode and the prefill wrapper."""
    config = AttentionConfig(
        num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, scale=0.05, softcap=1.5
    )
    backend = FlashInferPagedAttention(config, "cuda", torch.bfloat16)
    specs, q, k_cache, v_cache, new_kv = make_batch(config, shapes, torch.bfloat16, seed=11)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).cuda()
    scores = ScoreParams(config.softmax_scale, config.softcap, sinks)
    check_step(backend, specs, 0, q, k_cache, v_cache, new_kv, scores)
    with pytest.raises(ValueError, match="sm_scale"):
        backend.run(q, k_cache, v_cache, backend.plan(specs, 1), ScoreParams(0.1, 1.5))


@needs_flashinfer
@pytest.mark.parametrize("shapes", [MIXED, DECODE], ids=["mixed", "decode"])
def test_freed_leading_pages_match_torch(shapes: list[tuple[int, int]]) -> None:
    """UNVERIFIED until run on a GPU: block tables from ``first_page`` on (a window of 33 freed
    the pages before it), prefill and decode."""
    config = AttentionConfig(
        num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, sliding_window=33
    )
    backend = FlashInferPagedAttention(config, "cuda", torch.bfloat16)
    specs, q, k_cache, v_cache, new_kv = make_batch(config, shapes, torch.bfloat16, 12, freed=True)
    assert any(s.first_page > 0 for s in specs)
    check_step(backend, specs, 0, q, k_cache, v_cache, new_kv)


@needs_flashinfer
def test_value_heads_smaller_than_key_heads_match_torch() -> None:
    """UNVERIFIED until run on a GPU: multi-head latent attention's shapes (K 192, V 128), which
    plan decode batches with the prefill wrapper (``head_dim_vo``)."""
    config = AttentionConfig(
        num_heads=8, num_kv_heads=8, head_dim=192, page_size=16, v_head_dim=128
    )
    backend = FlashInferPagedAttention(config, "cuda", torch.bfloat16)
    for shapes, seed in ((MIXED, 13), (DECODE, 14)):
        specs, q, k_cache, v_cache, new_kv = make_batch(config, shapes, torch.bfloat16, seed)
        assert check_step(backend, specs, 0, q, k_cache, v_cache, new_kv) == "prefill"


@needs_flashinfer
def test_double_buffered_pipeline_and_stale_metadata() -> None:
    """Steps planned one ahead on the planning thread alternate wrappers and each matches the
    reference; metadata whose slot was planned again is refused."""
    dtype = torch.bfloat16
    config = AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16)
    backend = FlashInferPagedAttention(config, "cuda", dtype)
    specs, _, k_cache, v_cache, _ = make_batch(config, [(0, 40), (9, 1), (30, 8)], dtype, 3)
    tables = [(*s.block_table, 999) for s in specs]  # a reserved page each, never read
    schedule = [[(s.context_len, s.query_len) for s in specs]]
    for _ in range(4):  # decode steps; lengths 44, 14, 42 still fit the planned pages
        schedule.append([(c + n, 1) for c, n in schedule[-1]])
    batches = [[SequenceSpec(t, c, n) for t, (c, n) in zip(tables, step)] for step in schedule]
    g = torch.Generator().manual_seed(0)
    with DoubleBufferedPlanner(backend) as planner:
        planner.submit(batches[0])
        for n, batch in enumerate(batches):
            meta = planner.take()
            assert meta.slot == n % 2
            if n + 1 < len(batches):
                planner.submit(batches[n + 1])
            tokens = meta.total_query_tokens
            step_q = torch.randn(tokens, 8, HEAD_DIM, generator=g).to("cuda", dtype)
            step_kv = torch.randn(2, tokens, 2, HEAD_DIM, generator=g).to("cuda", dtype)
            write_kv(k_cache, v_cache, meta.slot_mapping, step_kv[0], step_kv[1])
            got = backend.run(step_q, k_cache, v_cache, meta).float()
            want = reference(config, batch, step_q, k_cache, v_cache)
            tol = tolerance(config, batch, v_cache)
            assert (got - want).abs().max().item() <= tol
    old = backend.plan(batches[-1], 0)
    backend.plan(batches[-1], 0)
    with pytest.raises(RuntimeError, match="stale"):
        backend.run(torch.zeros_like(step_q), k_cache, v_cache, old)


@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_on_cuda_matches_cpu(window: int | None) -> None:
    config = AttentionConfig(
        num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, sliding_window=window
    )
    specs, q, k_cache, v_cache, new_kv = make_batch(config, MIXED, torch.float32, seed=9)
    scores = ScoreParams(0.1, 2.0, torch.randn(8).cuda())  # the explicit path too
    outs = []
    for device in ("cuda", "cpu"):
        backend = TorchPagedAttention(config, device)
        meta = backend.plan(specs)
        kc, vc = k_cache.to(device), v_cache.to(device)
        write_kv(kc, vc, meta.slot_mapping, new_kv[0].to(device), new_kv[1].to(device))
        outs.append(backend.run(q.to(device), kc, vc, meta).cpu())
        sinks = scores.sinks.to(device)  # type: ignore[union-attr]
        outs.append(backend.run(q.to(device), kc, vc, meta, ScoreParams(0.1, 2.0, sinks)).cpu())
    assert torch.allclose(outs[0], outs[2], atol=1e-5, rtol=0)
    assert torch.allclose(outs[1], outs[3], atol=1e-5, rtol=0)
