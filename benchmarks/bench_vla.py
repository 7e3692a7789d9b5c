"""pi0.5 action chunks, served vs eager PyTorch: ``python benchmarks/bench_vla.py [--quick]``.

The model is ``walkserve.adapters.pi05:medium`` (2 cameras of 64x64 through a 2-layer SigLIP
of width 128, 64 tokens each; a 4-layer Gemma of width 256, 8 heads of 32, one key/value
head; a 48-token prompt budget and 32 state tokens: a 208-token prefix; an expert of width 128
producing pi0's chunk of 50 actions of 32 in 10 Euler steps; seeded random weights, fp32).
Requests differ in images, prompt (4 to 48 tokens), state and noise. Each method runs in a
fresh process:

    recompute   eager, one request at a time, the whole model recomputed over [prefix;
                actions] at every Euler step (``native.sample_actions_recompute``: a stack
                without a KV cache)
    cached      eager, one request at a time, the prefix once and the expert per step
                (``native.sample_actions_cached``: plain PyTorch with the prefix cached)
    served1     serve() on one rank: ``act`` walks, prefixes and expert steps batched across
                the requests in flight
    served2     serve() with the prefix encoder on rank 0 and the expert on rank 1
                (``walkserve/adapters/pi05/placements/pi05.2ranks.yaml``)

Each reports the latency p50 at concurrency 1 (``--reps`` requests one after the other, after
a warm-up request) and actions per second at concurrency 8 (``--requests`` requests, 8 in
flight at all times for the served methods; for the eager ones one after the other, as a
per-request policy server runs them): requests x 50 actions / wall time. Served actions are
checked against ``sample_actions_cached`` on the same inputs (max error relative to
max|actions|). Workers use ``(cores - 1) / ranks`` torch threads (at least 1); the eager
processes every core.
Writes ``benchmarks/results/vla_pi05.json`` (cpu count, torch version, git commit, load
average before each method). ``--quick``: the ``tiny`` model, 16 requests, 3 reps. Small
shared VMs are noisy (+-20% or worse): compare ratios from one run.
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

# Idle OpenMP threads sleep instead of spinning (set before torch loads; inherited by the
# per-method processes and their workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from walkserve.benchmarking import write_result

ROOT = Path(__file__).resolve().parents[1]
TWO_RANKS = ROOT / "walkserve/adapters/pi05/placements/pi05.2ranks.yaml"
METHODS = ("recompute", "cached", "served1", "served2")
CONCURRENCY = 8
CHECKED = 8  # served requests compared with the eager policy


def requests(policy: Any, n: int, seed: int) -> list[dict[str, Any]]:
    from walkserve.adapters.pi05 import sample_inputs

    budget = policy.cfg.max_prompt_len
    return [
        sample_inputs(policy, prompt_len=4 + (7 * i) % (budget - 3), seed=seed + i)
        for i in range(n)
    ]


def run_eager(args: argparse.Namespace, method: str) -> dict[str, Any]:
    from walkserve.adapters import pi05
    from walkserve.adapters.pi05 import native

    policy, _ = getattr(pi05, args.model)()
    fn = native.sample_actions_recompute if method == "recompute" else native.sample_actions_cached

    def one(r: dict[str, Any]) -> float:
        start = time.perf_counter()
        fn(policy, **r)
        return time.perf_counter() - start

    one(requests(policy, 1, 999)[0])  # first-call costs stay out of the timing
    latencies = [one(r) for r in requests(policy, args.reps, 500)]
    reqs = requests(policy, args.requests, 0)
    start = time.perf_counter()
    for r in reqs:  # "concurrency 8" for a per-request caller: one after the other
        one(r)
    wall = time.perf_counter() - start
    return summarize(latencies, len(reqs) * policy.cfg.action_horizon / wall)


def run_served(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    from walkserve.adapters import pi05
    from walkserve.adapters.pi05 import native
    from walkserve.runtime.config import PoolConfig
    from walkserve.runtime.server import serve
    from walkserve.runtime.shm import ShmPoolConfig

    policy, _ = getattr(pi05, args.model)()
    placement = TWO_RANKS if ranks == 2 else None
    reqs = requests(policy, args.requests, 0)
    # Every expert step ships each request's prefix keys and values (loop invariants) from
    # the conductor: 2 values per request per batch, 106 KiB each for ``medium``, above the
    # 64 KiB inline limit. The default pools (4 slots per size class here, 8 per worker)
    # cannot hold a batch of 8 such requests.
    slots = 8 * CONCURRENCY
    pool = PoolConfig(shm=ShmPoolConfig(slots_per_class=slots), worker_shm_slots_per_class=slots)
    name = f"walkserve.adapters.pi05:{args.model}"
    with serve(name, placement, pool_config=pool) as server:

        def one(r: dict[str, Any]) -> tuple[float, torch.Tensor]:
            start = time.perf_counter()
            out = server.run(r, "act", timeout=600)["actions"]
            return time.perf_counter() - start, out

        warm = [server.submit(r, "act") for r in requests(policy, CONCURRENCY, 999)]
        for handle in warm:  # warm-up: first calls, batched ones too
            handle.result(timeout=600)
        one(requests(policy, 1, 998)[0])
        latencies = [one(r)[0] for r in requests(policy, args.reps, 500)]
        start = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:  # 8 in flight at all times
            results = list(pool.map(one, reqs))
        wall = time.perf_counter() - start
        batches = dict(sorted(server.batch_sizes.items()))
    error = 0.0
    for r, (_, got) in zip(reqs[:CHECKED], results[:CHECKED]):
        want = native.sample_actions_cached(policy, **r)
        error = max(error, float((got - want).abs().max() / want.abs().max()))
    summary = summarize(latencies, len(reqs) * policy.cfg.action_horizon / wall)
    summary["max_rel_error_vs_cached"] = error
    summary["dispatch_batch_sizes"] = {str(k): v for k, v in batches.items()}
    return summary


def summarize(latencies: list[float], actions_per_s: float) -> dict[str, Any]:
    return {
        "latency_p50_s": statistics.median(latencies),
        "latency_min_s": min(latencies),
        "latencies_s": latencies,
        "actions_per_s_concurrency8": actions_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 16 requests, 3 reps")
    parser.add_argument("--requests", type=int, default=32, help="requests at concurrency 8")
    parser.add_argument("--reps", type=int, default=5, help="requests at concurrency 1")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vla_pi05.json")
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="medium", choices=("tiny", "medium"))
    args = parser.parse_args()
    if args.quick:
        args.model, args.requests, args.reps = "tiny", 16, 3
    if args.requests < CONCURRENCY or args.reps < 1:
        raise ValueError(f"--requests must be >= {CONCURRENCY} and --reps >= 1")
    if args.method:
        if args.method in ("recompute", "cached"):
            result = run_eager(args, args.method)
        else:
            result = run_served(args, 1 if args.method == "served1" else 2)
        print(json.dumps(result))
        return

    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        cmd = [sys.executable, __file__, "--method", method, "--model", args.model]
        cmd += ["--requests", str(args.requests), "--reps", str(args.reps)]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{proc.stderr[-4000:]}")
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[method]["loadavg_1min_before"] = load
        r = results[method]
        print(
            f"{method:>9}: latency p50 {r['latency_p50_s'] * 1e3:7.1f} ms  "
            f"{r['actions_per_s_concurrency8']:8.1f} actions/s at 8  (load {load:.2f})",
            flush=True,
        )
    summary = summarise(args, results)
    write_result(args.out, summary, load_before)
    print(summary["readme_rows"][0]["result"])
    print(f"wrote {args.out}")


def summarise(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    thr = {m: r["actions_per_s_concurrency8"] for m, r in results.items()}
    lat = {m: r["latency_p50_s"] for m, r in results.items()}
    ratios = {
        f"{s}_vs_{b}_actions_per_s": thr[s] / thr[b]
        for s in ("served1", "served2")
        for b in ("recompute", "cached")
    }
    ratios |= {f"{s}_vs_cached_latency_p50": lat[s] / lat["cached"] for s in ("served1", "served2")}
    error = max(results[s]["max_rel_error_vs_cached"] for s in ("served1", "served2"))
    loads = "/".join(f"{results[m]['loadavg_1min_before']:.1f}" for m in METHODS)
    text = (
        f"actions/s at concurrency 8: recompute {thr['recompute']:.0f}, cached {thr['cached']:.0f},"
        f" served 1 rank {thr['served1']:.0f} ({ratios['served1_vs_recompute_actions_per_s']:.2f}x"
        f" recompute, {ratios['served1_vs_cached_actions_per_s']:.2f}x cached), served 2 ranks"
        f" {thr['served2']:.0f} ({ratios['served2_vs_recompute_actions_per_s']:.2f}x /"
        f" {ratios['served2_vs_cached_actions_per_s']:.2f}x); latency p50 at concurrency 1:"
        f" recompute {lat['recompute'] * 1e3:.0f} ms, cached {lat['cached'] * 1e3:.0f} ms,"
        f" served {lat['served1'] * 1e3:.0f} ms / {lat['served2'] * 1e3:.0f} ms"
        f" ({ratios['served1_vs_cached_latency_p50']:.2f}x /"
        f" {ratios['served2_vs_cached_latency_p50']:.2f}x cached); max error vs cached"
        f" {error:.1e}; 1-min load before each method {loads}"
    )
    from walkserve.benchmarking import machine_info

    info = machine_info()
    where = f"{info['cpu_count']} CPUs, torch {info['torch']}"
    where += f", @{str(info['git_commit'])[:7]}" if info["git_commit"] else ""
    what = (
        f"pi0.5 action chunks (50 x 32, 10 Euler steps), served vs eager, `pi05:{args.model}`"
        " (`benchmarks/bench_vla.py`, `benchmarks/results/vla_pi05.json`"
        + (" --quick)" if args.quick else ")")
    )
    if args.model == "tiny":
        what = what.replace("50 x 32", "8 x 6")
    return {
        "benchmark": "vla_pi05",
        "model": f"walkserve.adapters.pi05:{args.model}",
        "quick": args.quick,
        "requests": args.requests,
        "reps": args.reps,
        "concurrency": CONCURRENCY,
        "results": results,
        **ratios,
        "max_rel_error_vs_cached": error,
        "targets": {
            "served_vs_recompute_actions_per_s": 3.0,
            "served_vs_cached_actions_per_s": 1.5,
            "served_vs_cached_latency_p50_at_most": 1.2,
        },
        "readme_rows": [{"benchmark": what, "machine": where, "result": text}],
    }


if __name__ == "__main__":
    main()
