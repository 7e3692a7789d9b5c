"""Rounds served while a worker's heap is frozen, or not: ``python benchmarks/bench_heap.py``.

A worker holds torch, its model and its plan for its whole life (~200k objects): each full
collection of Python's cyclic collector walks them all again (~0.1 s on the 2-core VM) while
every request in flight waits. ``PoolConfig.freeze_heap`` (the default) freezes them once the
worker is set up (``runtime.heap``). Here ``bench_loops``'s rollout model (30 steps) serves
rounds of 16 concurrent requests back to back for ``SECONDS`` with the heap frozen and
not, twice each, alternating (so that the VM's drift hits both); per setting: the rounds'
p50, p99 and slowest wall time, how many rounds took over 4x the p50, and the worker's full
collections (its ``gc/full_collections`` counter). Writes ``benchmarks/results/heap.json``.
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

from walkserve.benchmarking import write_result

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 20.0  # of rounds per setting and pass
CONCURRENT = 16


def serve_rounds(freeze: bool, seconds: float) -> tuple[list[float], int]:
    """Rounds of ``CONCURRENT`` rollouts for ``seconds``: their wall times, and the full
    collections the worker ran meanwhile."""
    from walkserve.runtime.config import PoolConfig
    from walkserve.runtime.server import serve

    walls: list[float] = []
    with serve("loop_models:rollout", threads=1, pool_config=PoolConfig(freeze_heap=freeze)) as s:
        for seed in range(3):  # warm-up
            s.run(loop_models.rollout_inputs(seed, 30), "rollout", timeout=600)
        before = s.stats().ranks[0].counters.get("gc/full_collections", 0)
        end = time.monotonic() + seconds
        k = 0
        while time.monotonic() < end:
            batch = [loop_models.rollout_inputs(k * CONCURRENT + i, 30) for i in range(CONCURRENT)]
            k += 1
            t0 = time.perf_counter()
            futures = [s.submit_future(r, "rollout", stream=False) for r in batch]
            for f in futures:
                f.result(timeout=600).result(timeout=600)
            walls.append(time.perf_counter() - t0)
        after = s.stats().ranks[0].counters.get("gc/full_collections", 0)
    return walls, after - before


def summary(walls: list[float], collections: int) -> dict[str, Any]:
    ordered = sorted(walls)
    p50 = statistics.median(ordered)
    return {
        "rounds": len(walls),
        "p50_s": p50,
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_s": ordered[-1],
        "rounds_over_4x_p50": sum(w > 4 * p50 for w in walls),
        "full_collections": collections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=SECONDS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = list(os.getloadavg())
    walls: dict[str, list[float]] = {"frozen": [], "not frozen": []}
    collections = {"frozen": 0, "not frozen": 0}
    for _ in range(2):
        for name, freeze in (("not frozen", False), ("frozen", True)):
            w, c = serve_rounds(freeze, args.seconds)
            walls[name] += w
            collections[name] += c
    results = {name: summary(walls[name], collections[name]) for name in walls}
    parts = []
    for name, r in results.items():
        parts.append(
            f"{name}: {r['rounds']} rounds, p50 {r['p50_s'] * 1e3:.3g} ms, p99"
            f" {r['p99_s'] * 1e3:.3g} ms, slowest {r['max_s'] * 1e3:.3g} ms,"
            f" {r['rounds_over_4x_p50']} over 4x p50, {r['full_collections']} full collections"
        )
        print(parts[-1])
    from walkserve.benchmarking import git_commit

    machine = f"{os.cpu_count()} CPUs, torch {torch.__version__}, @{(git_commit() or '')[:7]}"
    write_result(
        ROOT / "benchmarks/results/heap.json",
        {
            "benchmark": "heap",
            "seconds_per_setting": 2 * args.seconds,
            "concurrent": CONCURRENT,
            "results": results,
            "readme_rows": [
                {
                    "benchmark": "rounds of 16 concurrent served rollouts back to back, the"
                    " worker's heap frozen once set up (the default) or not"
                    " (`benchmarks/bench_heap.py`, `benchmarks/results/heap.json`)",
                    "machine": machine,
                    "result": "; ".join(parts) + f"; 1-min load {load[0]:.1f} before",
                }
            ],
        },
        loadavg_before=load,
    )


if __name__ == "__main__":
    main()
