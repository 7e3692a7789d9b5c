"""On a CUDA machine: every example component replayed from CUDA graphs (one per batch bucket)
against its eager batched twin, on batches of 1 to 8 requests. Skipped without CUDA.

Tolerance: a graph recorded for bucket b runs the GEMMs at batch b, the eager call at the
group's own size, so results may differ by kernel reassociation: max|graph - eager| <= 1e-4 *
max|eager| (float32), identical for integer outputs."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from walkserve import capture  # noqa: E402
from walkserve.adapters.examples import EXAMPLES, build_example  # noqa: E402
from walkserve.lowering.batchdims import analyze  # noqa: E402
from walkserve.lowering.batched import BatchedComponent  # noqa: E402
from walkserve.lowering.lower import lower  # noqa: E402

BUCKETS = [1, 2, 4, 8]
TIMINGS: dict[str, Any] = {}


def to_cuda(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cuda()
    if isinstance(x, (list, tuple)):
        return type(x)(to_cuda(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cuda(v) for k, v in x.items()}
    return x


def perturb(call: Any, dims: list[Any], kw_dims: dict[str, Any], seed: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(v: Any, d: Any) -> Any:
        if isinstance(d, int) and isinstance(v, torch.Tensor) and v.is_floating_point():
            return v + 0.01 * torch.randn(v.shape, generator=g, device="cuda", dtype=v.dtype)
        return v

    args, kwargs = call
    return [one(a, d) for a, d in zip(args, dims)], {
        k: one(v, kw_dims.get(k)) for k, v in kwargs.items()
    }


def close(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not a.is_floating_point():
            return bool(torch.equal(a, b))
        return (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1e-30)
    if isinstance(a, (tuple, list)):
        return all(close(x, y) for x, y in zip(a, b))
    return True


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_graph_replay_matches_eager(name: str) -> None:
    from walkserve.lowering.cudagraph import GraphedComponent

    model, sample = build_example(name)
    captured = capture.trace(model, sample)
    plan = lower(captured, sample, device="cuda", check_capture=True)
    analysis = analyze(captured, sample)
    model.cuda()
    checked = 0
    for walk in plan.walks:
        for node in plan.nodes(walk):
            if node.kind != "component" or not node.compile.cuda_graph:
                continue
            template = to_cuda(analysis.samples[walk][node.ops[0]])
            module = model.get_submodule(node.target)
            eager = BatchedComponent(node.name, module, node.in_dims, node.kw_dims, node.out_dim)
            graphed = GraphedComponent(
                node.name, module, node.in_dims, node.kw_dims, node.out_dim, BUCKETS, template
            )
            for n in (1, 3, 5, 8):
                batch = [
                    perturb(template, node.in_dims, node.kw_dims, 100 * n + i) for i in range(n)
                ]
                with torch.no_grad():
                    want = eager(batch)
                    got = graphed(batch)
                assert all(close(g, w) for g, w in zip(got, want)), f"{walk}:{node.name} batch {n}"
            assert graphed.replays > 0
            batch8 = [perturb(template, node.in_dims, node.kw_dims, i) for i in range(8)]
            timings = {}
            for label, fn in (("eager", eager), ("graph", graphed)):
                with torch.no_grad():
                    for _ in range(3):
                        fn(batch8)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn(batch8)
                    torch.cuda.synchronize()
                timings[label] = (time.perf_counter() - t0) / 20 * 1e6
            TIMINGS[f"{name}/{walk}:{node.name}"] = {
                **timings,
                "speedup": timings["eager"] / timings["graph"],
            }
            checked += 1
    assert checked > 0
    out = os.environ.get("WALKSERVE_GPU_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(),
                    "us_per_call_batch8": TIMINGS,
                },
                f,
                indent=1,
            )
