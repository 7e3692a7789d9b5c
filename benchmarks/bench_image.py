"""Image generation, diffusers SD3 walks vs the upstream pipeline:
``python benchmarks/bench_image.py [--quick]``.

The model is ``walkserve.adapters.diffusers_dit:bench``: a random StableDiffusion3Pipeline built
in code (two CLIP encoders of width 64, a 4-layer SD3 transformer of width 128 with 8 heads,
32x32 images from 16x16 latents, patch 1: 256 image tokens + 24 context tokens, fp32), true
classifier-free guidance (two transformer calls per step), ``--steps`` (8) Euler steps.
Three ways, each in a fresh process:

    pipeline   StableDiffusion3Pipeline.__call__ per request, one request at a time (it batches
               the two guidance branches as one call of batch 2)
    served1    serve() on one rank (continuous batching across requests and branches)
    served2    serve() with the two guidance branches on two ranks
               (walkserve/adapters/placements/diffusers-dit.2ranks.yaml)

Each reports image latency p50/p95 at concurrency 1 (``--requests`` requests one after the
other), images per second at concurrency 4 (the same number of requests, 4 in flight; for the
pipeline: one after the other, as a per-request caller would), and per-step latency:
(latency at ``--steps`` steps - latency at 1 step) / (steps - 1), medians of requests at
concurrency 1. Served images are checked against the pipeline's for the same seed (max error).
Workers use ``(cores - 1) / ranks`` torch threads, at least 1 (one per rank on 2 cores); the
pipeline process uses every core. Writes ``benchmarks/results/image_diffusers.json`` (cpu count,
torch version, git commit, load average). ``--quick``: 4 requests, 4 steps. Small shared VMs are
noisy (+-20% or worse): compare ratios from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from walkserve.benchmarking import write_result

# Idle OpenMP threads sleep instead of spinning (set before torch loads; inherited by the
# per-method processes and their workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MODEL = "walkserve.adapters.diffusers_dit:bench"
TWO_RANKS = ROOT / "walkserve/adapters/placements/diffusers-dit.2ranks.yaml"
METHODS = ("pipeline", "served1", "served2")
PROMPTS = ("a red square", "a blue circle on grass", "two cats", "a city at night")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def requests(n: int, steps: int) -> list[dict[str, Any]]:
    return [
        {"prompt": PROMPTS[i % len(PROMPTS)], "seed": i, "steps": steps, "guidance_scale": 5.0}
        for i in range(n)
    ]


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    from walkserve.adapters import diffusers_dit as D
    from walkserve.adapters.diffusers_upstream import pipeline_image

    walks, _ = D.bench()
    reqs = requests(args.requests, args.steps)

    def one(r: dict[str, Any]) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        inputs = D.request_inputs(walks, **r)
        image = pipeline_image(walks, inputs, **r)
        return time.perf_counter() - start, image

    one(requests(1, 1)[0])  # first-call costs stay out of the timing
    latencies = [one(r)[0] for r in reqs]
    one_step = [one({**r, "steps": 1})[0] for r in reqs]
    start = time.perf_counter()
    for r in reqs:  # "concurrency 4" for a per-request caller: one after the other
        one(r)
    throughput = len(reqs) / (time.perf_counter() - start)
    return summarize(latencies, one_step, throughput, args.steps)


def run_served(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    from walkserve.adapters import diffusers_dit as D
    from walkserve.adapters.diffusers_upstream import pipeline_image
    from walkserve.runtime.server import serve

    walks, _ = D.bench()
    reqs = requests(args.requests, args.steps)
    inputs = [D.request_inputs(walks, **r) for r in reqs]
    placement = TWO_RANKS if ranks == 2 else None
    with serve(MODEL, placement) as server:

        def one(x: dict[str, Any]) -> tuple[float, torch.Tensor]:
            start = time.perf_counter()
            out = server.run(x, "generate")
            return time.perf_counter() - start, out["image"]

        one(D.request_inputs(walks, "warm up", steps=1))
        results = [one(x) for x in inputs]
        latencies = [t for t, _ in results]
        one_step = [one(D.request_inputs(walks, **{**r, "steps": 1}))[0] for r in reqs]
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:  # 4 in flight at all times
            list(pool.map(one, inputs))
        throughput = len(inputs) / (time.perf_counter() - start)
    want = pipeline_image(walks, inputs[0], **reqs[0])
    summary = summarize(latencies, one_step, throughput, args.steps)
    summary["max_error_vs_pipeline"] = (results[0][1] - want).abs().max().item()
    return summary


def summarize(
    latencies: list[float], one_step: list[float], throughput: float, steps: int
) -> dict[str, Any]:
    p50 = statistics.median(latencies)
    per_step = (p50 - statistics.median(one_step)) / (steps - 1) if steps > 1 else None
    return {
        "latency_p50_s": p50,
        "latency_p95_s": percentile(latencies, 0.95),
        "latency_1step_p50_s": statistics.median(one_step),
        "per_step_s": per_step,
        "images_per_s_concurrency4": throughput,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 requests, 4 steps")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/image_diffusers.json"
    )
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.steps = 4, 4
    if args.steps < 2:
        raise ValueError("--steps must be >= 2 (per-step latency compares with 1-step requests)")
    if args.method:
        if args.method == "pipeline":
            result = run_pipeline(args)
        else:
            result = run_served(args, 1 if args.method == "served1" else 2)
        print(json.dumps(result))
        return

    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        cmd = [sys.executable, __file__, "--method", method]
        cmd += ["--requests", str(args.requests), "--steps", str(args.steps)]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{proc.stderr[-4000:]}")
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[method]["loadavg_1min_before"] = load
        r = results[method]
        print(
            f"{method:>9}: p50 {r['latency_p50_s']:.3f} s  p95 {r['latency_p95_s']:.3f} s  "
            f"{r['images_per_s_concurrency4']:.2f} images/s at 4  "
            f"per step {r['per_step_s'] * 1e3:.1f} ms"
        )
    pipe, one, two = results["pipeline"], results["served1"], results["served2"]
    summary = {
        "benchmark": "image_diffusers",
        "model": MODEL,
        "quick": args.quick,
        "requests": args.requests,
        "steps": args.steps,
        "results": results,
        "served1_vs_pipeline_images_per_s": one["images_per_s_concurrency4"]
        / pipe["images_per_s_concurrency4"],
        "served2_vs_pipeline_images_per_s": two["images_per_s_concurrency4"]
        / pipe["images_per_s_concurrency4"],
        "served1_vs_pipeline_latency_p50": one["latency_p50_s"] / pipe["latency_p50_s"],
        "two_ranks_vs_one_rank_per_step": two["per_step_s"] / one["per_step_s"],
    }
    write_result(args.out, summary, load_before)
    print(
        f"images/s at 4: served1 / pipeline = {summary['served1_vs_pipeline_images_per_s']:.2f}x, "
        f"served2 / pipeline = {summary['served2_vs_pipeline_images_per_s']:.2f}x; "
        f"per step two ranks / one rank = {summary['two_ranks_vs_one_rank_per_step']:.2f}; "
        f"wrote {args.out}"
    )


if __name__ == "__main__":
    main()
