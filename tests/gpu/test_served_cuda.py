"""On a CUDA machine: a served loop whose worker runs on the GPU (``LoweringConfig(device=
"cuda")``: the worker puts its components there, inputs are moved there as decoded, the
capturable nodes replay CUDA graphs recorded at their first call), against the same walk run
eagerly on the GPU. Skipped without CUDA.

Tolerance: a graph recorded for bucket b runs the GEMMs at batch b, the eager call at the
request's own size, so results may differ by kernel reassociation: max|served - eager| <=
1e-4 * max|eager| (float32)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import loop_models  # noqa: E402

from walkserve.runtime.config import LoweringConfig  # noqa: E402
from walkserve.runtime.server import serve  # noqa: E402


def eager(model: Any, walk: str, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        out = getattr(model, walk)(**cuda)
    return {k: v.cpu() for k, v in out.items()}


@pytest.mark.parametrize(
    ("factory", "walk", "make", "length"),
    [
        ("rollout", "rollout", loop_models.rollout_inputs, 30),
        ("speech", "speak", loop_models.speech_inputs, 96),
    ],
)
def test_a_served_loop_runs_on_the_gpu_from_cuda_graphs(
    factory: str, walk: str, make: Any, length: int
) -> None:
    model, _ = getattr(loop_models, factory)()
    model = model.cuda()
    lowering = LoweringConfig(device="cuda")
    with serve(f"loop_models:{factory}", lowering=lowering) as server:
        for n in (1, 5, 16):  # alone, a batch between buckets, a full bucket
            inputs = [make(100 * n + i, length) for i in range(n)]
            futures = [server.submit_future(r, walk, stream=False) for r in inputs]
            for r, f in zip(inputs, futures):
                got = f.result(timeout=300).result(timeout=300)
                want = eager(model, walk, r)
                for k, w in want.items():
                    g = got[k]
                    assert g.device.type == "cpu" and g.shape == w.shape, k
                    if w.is_floating_point():
                        assert (g - w).abs().max() <= 1e-4 * w.abs().max().clamp_min(1e-30), k
                    else:
                        assert torch.equal(g, w), k
        counters = server.stats().counters
    replays = {k: v for k, v in counters.items() if k.endswith("/graph_replays")}
    refused = {k: v for k, v in counters.items() if k.endswith("/graphs_refused")}
    assert replays and all(v > 0 for v in replays.values()), counters
    assert not any(refused.values()), refused
