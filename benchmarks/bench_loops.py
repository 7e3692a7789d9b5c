"""Served loops vs the same loops run eagerly: ``python benchmarks/bench_loops.py [--quick]``.

The issue's measurement, as a new user would make it: two plain PyTorch loops decorated as the
README shows (``loop_models.py``), served on one rank with ``serve()``, against the model's own
walk methods called in this process (Python ``for`` loops, no runtime):

    rollout   a 30-step rollout of a small action-conditioned predictor (MLP, width 256)
    speech    a 96-step recurrent LM (GRU, width 256) streamed into a sliding-window decoder
              (SlidingWindow(16, 8): 11 windows)

Both sides use the same torch thread count: the worker's default (``default_threads``: the
cores but one, so 1 on 2 cores), set in this process for the eager loops too (on a 2-core host
torch's own default of 2 makes the eager loops 2x-4x slower, which would flatter the served
ratio); ``BENCH_THREADS`` sets another. For each: latency at batch 1 (p50 of ``--reps``
requests, served and eager alternating so load drift hits both; ratio served / eager, target <=
1.2; and the CPU seconds the server process and its worker spent per request over the eager
loop's, which other load on a small host disturbs less than wall time), and 16 concurrent
requests served vs the same 16 run eagerly one after another (throughput ratio, target >= 4;
the median of ``ROUNDS`` rounds). Every served
output is checked against the eager one. Writes ``benchmarks/results/loops.json`` (cpu count,
torch version, git commit, load average). Small shared VMs are noisy: compare ratios of one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # loop_models, for the workers too

import loop_models

from walkserve.benchmarking import tree_cpu_seconds, write_result

ROOT = Path(__file__).resolve().parents[1]
THREADS = int(os.environ.get("BENCH_THREADS", "0")) or None  # None: default_threads(1)
ROUNDS = 5  # rounds of the concurrent measurement: the median's figures are reported
CASES = {
    "rollout": (
        "loop_models:rollout",
        "rollout",
        lambda seed: loop_models.rollout_inputs(seed, 30),
    ),
    "speech": ("loop_models:speech", "speak", lambda seed: loop_models.speech_inputs(seed, 96)),
}


def check(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Largest error relative to max|want| over the outputs (integers must be equal)."""
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        if not w.is_floating_point():
            assert torch.equal(g, w), k
            continue
        worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)))
    return worst


def bench(name: str, reps: int, concurrent: int) -> dict[str, Any]:
    from walkserve.runtime.config import default_threads
    from walkserve.runtime.server import serve

    threads = THREADS or default_threads(1)
    torch.set_num_threads(threads)  # the eager loops run with the worker's threads

    factory, walk, inputs = CASES[name]
    model, _ = getattr(loop_models, factory.split(":")[1])()
    method = getattr(model, walk)

    def eager(r: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            return method(**r)  # type: ignore[no-any-return]

    with serve(factory, threads=threads) as server:
        for seed in range(3):  # warm-up: first calls of every node, both ways
            server.run(inputs(seed), walk, timeout=600)
            eager(inputs(seed))
        served_s: list[float] = []
        eager_s: list[float] = []
        served_cpu = eager_cpu = 0.0
        error = 0.0
        for i in range(reps):
            r = inputs(100 + i)
            t0, c0 = time.perf_counter(), time.process_time()
            want = eager(r)
            eager_s.append(time.perf_counter() - t0)
            eager_cpu += time.process_time() - c0
            t0, c0 = time.perf_counter(), tree_cpu_seconds()
            got = server.run(r, walk, timeout=600)
            served_s.append(time.perf_counter() - t0)
            c1 = tree_cpu_seconds()
            served_cpu += c1 - c0 if c0 is not None and c1 is not None else float("nan")
            error = max(error, check(got, want))
        ratios: list[tuple[float, float, float]] = []  # (eager / served, eager, served)
        for k in range(ROUNDS):  # each a new batch, eager then served
            batch = [inputs(1000 + 100 * k + i) for i in range(concurrent)]
            t0 = time.perf_counter()
            wants = [eager(r) for r in batch]
            eager_wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            # concurrent clients: none waits for another's admission (as HTTP clients and
            # submit_async); a blocking submit() loop would serialize them
            futures = [server.submit_future(r, walk, stream=False) for r in batch]
            gots = [f.result(timeout=600).result(timeout=600) for f in futures]
            served_wall = time.perf_counter() - t0
            ratios.append((eager_wall / served_wall, eager_wall, served_wall))
            for got, want in zip(gots, wants):
                error = max(error, check(got, want))
        _, eager_wall, served_wall = sorted(ratios)[len(ratios) // 2]  # the median round
        stats = server.stats()
        sizes = server.batch_sizes
    served, eager_p50 = statistics.median(served_s), statistics.median(eager_s)
    return {
        "walk": walk,
        "threads": threads,
        "served_p50_s": served,
        "eager_p50_s": eager_p50,
        "served_over_eager": served / eager_p50,
        # CPU seconds of the server process and its workers per request over the eager
        # loop's (clock ticks: meaningful over many reps only)
        "cpu_served_over_eager": served_cpu / eager_cpu if eager_cpu > 0 else None,
        "concurrent": concurrent,
        "served_concurrent_req_per_s": concurrent / served_wall,
        "eager_one_by_one_req_per_s": concurrent / eager_wall,
        "throughput_ratio": eager_wall / served_wall,
        "max_rel_error": error,
        "speculated_steps": stats.speculated_steps,
        "wasted_steps": stats.wasted_steps,
        "largest_batch": max(sizes) if sizes else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 reps, 8 concurrent")
    parser.add_argument("--full", action="store_true", help="(the default sizes)")
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    reps, concurrent = (5, 8) if args.quick else (args.reps, 16)
    load = list(os.getloadavg())
    results = {name: bench(name, reps, concurrent) for name in CASES}
    for name, r in results.items():
        print(
            f"{name:8} batch 1: served {r['served_p50_s'] * 1e3:.2f} ms vs eager "
            f"{r['eager_p50_s'] * 1e3:.2f} ms ({r['served_over_eager']:.2f}x, CPU "
            f"{r['cpu_served_over_eager'] or float('nan'):.2f}x); {concurrent} "
            f"concurrent: {r['throughput_ratio']:.2f}x the eager one-by-one throughput "
            f"(largest batch {r['largest_batch']}, max rel error {r['max_rel_error']:.1e})"
        )
    write_result(
        ROOT / "benchmarks/results/loops.json",
        {"benchmark": "loops", "quick": args.quick, "reps": reps, "results": results},
        load,
    )


if __name__ == "__main__":
    main()
