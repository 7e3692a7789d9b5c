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
1.2; beside it the median of each request's served / eager pair, which a slow moment of the VM
landing on one side moves less than it moves one side's p50; and the CPU seconds the server
process and its worker spent per request over the eager loop's, which other load on a small
host disturbs less than wall time), the same in blocks of
``BLOCK`` requests each way, back to back (a steady client's view: alternating request by
request leaves the worker idle while the eager loop runs, so that each served request finds
it asleep, which costs it more than the eager one), and 16 concurrent
requests served vs the same 16 run eagerly one after another (throughput ratio, target >= 4;
the median of ``ROUNDS`` rounds, each eager then served), beside the bound batching alone gives
(the 16 as one batch through the eager loop), and the same ratio for rounds back to back
(blocks of ``STEADY_ROUNDS`` rounds each way: a loaded server's view, where a served round does
not start on a worker left idle by an eager round). Where batch-1 time goes: p50 pairs at a short and a long loop length
too (``CASES``), fitted as ``t = fixed + per_step * length`` for served and eager, give the
served path's fixed cost per request and its cost per step over eager's, and the loop length
from which served / eager is at most 1.2 on this machine. Every served
output is checked against the eager one. Writes ``benchmarks/results/loops.json`` (cpu count,
torch version, git commit, load average). Small shared VMs are noisy: compare ratios of one run.
``--device cuda`` (a GPU machine): the server lowered for CUDA (each worker puts its components
on its GPU; the capturable nodes replay CUDA graphs, counted in ``graph_replays``), the eager
loops on the same GPU with their inputs moved there and outputs back inside the timing, as a
served request's are; writes ``loops_cuda.json``.
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
# rounds of the concurrent measurement (each a new batch, eager then served): the median
# round's figures are reported. On the 2-core VM one round's ratio ranged 2.0-4.7 within one
# run of 15 (its speed changes within tens of ms, and the two sides of a round run at different
# moments); the median of 5 moved with that
ROUNDS = 15
BLOCK = 10  # requests per block of the back-to-back measurement
STEADY_ROUNDS = 8  # concurrent rounds per block of their back-to-back measurement
# factory, walk, inputs(seed, loop length), (short, standard, long) loop lengths: the standard
# one is the measurement, the other two place it on the overhead model
CASES: dict[str, tuple[str, str, Any, tuple[int, int, int]]] = {
    "rollout": ("loop_models:rollout", "rollout", loop_models.rollout_inputs, (1, 30, 120)),
    "speech": ("loop_models:speech", "speak", loop_models.speech_inputs, (16, 96, 384)),
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


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = fixed + per_step * n`` through (n, t) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def overhead_model(served: list[tuple[int, float]], eager: list[tuple[int, float]]) -> dict:
    """Where batch-1 time goes, from p50s at several loop lengths: the served loop's fixed cost
    per request and cost per step against eager's, and the length from which served / eager
    is at most 1.2 (None: never, a served step costs 1.2x an eager one or more)."""
    a, s = fit(served)
    e0, e = fit(eager)
    breakeven: float | None = None
    if 1.2 * e > s:
        breakeven = max(0.0, (a - 1.2 * e0) / (1.2 * e - s))
    return {
        "lengths": [n for n, _ in served],
        "served_p50_s": [t for _, t in served],
        "eager_p50_s": [t for _, t in eager],
        "served_fixed_s": a,
        "served_per_step_s": s,
        "eager_fixed_s": e0,
        "eager_per_step_s": e,
        "fixed_overhead_s": a - e0,
        "per_step_overhead_s": s - e,
        "length_for_1_2x": breakeven,
    }


def bench(name: str, reps: int, concurrent: int, device: str = "cpu") -> dict[str, Any]:
    from walkserve.runtime.config import LoweringConfig, default_threads
    from walkserve.runtime.server import serve

    threads = THREADS or default_threads(1)
    torch.set_num_threads(threads)  # the eager loops run with the worker's threads

    factory, walk, make, (short, standard, long) = CASES[name]

    def inputs(seed: int, n: int = standard) -> dict[str, Any]:
        return make(seed, n)  # type: ignore[no-any-return]

    model, _ = getattr(loop_models, factory.split(":")[1])()
    method = getattr(model.to(device), walk)

    def eager(r: dict[str, Any]) -> dict[str, Any]:
        """The walk method in this process; on a GPU its inputs go there and its outputs
        come back to the host (a served request's outputs do too), inside the timing."""
        if device == "cpu":
            with torch.no_grad():
                return method(**r)  # type: ignore[no-any-return]
        r = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in r.items()}
        with torch.no_grad():
            out = method(**r)
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    lowering = LoweringConfig(device=device)
    with serve(factory, threads=threads, lowering=lowering) as server:
        for seed in range(3):  # warm-up: first calls of every node, both ways
            server.run(inputs(seed), walk, timeout=600)
            eager(inputs(seed))
        error = 0.0
        cpu = [0.0, 0.0]  # served, eager CPU seconds of the standard length's requests

        def alternate(n: int, count: int, seed: int) -> tuple[list[float], list[float]]:
            """``count`` requests of loop length ``n``, each eagerly then served: the wall
            times (and, at the standard length, the CPU seconds in ``cpu``)."""
            nonlocal error
            served_t: list[float] = []
            eager_t: list[float] = []
            for i in range(count):
                r = inputs(seed + i, n)
                t0, c0 = time.perf_counter(), time.process_time()
                want = eager(r)
                eager_t.append(time.perf_counter() - t0)
                if n == standard:
                    cpu[1] += time.process_time() - c0
                tree0 = tree_cpu_seconds() if n == standard else 0.0  # outside the wall time
                t0 = time.perf_counter()
                got = server.run(r, walk, timeout=600)
                served_t.append(time.perf_counter() - t0)
                if n == standard:
                    tree1 = tree_cpu_seconds()
                    if tree0 is None or tree1 is None:  # no /proc here
                        cpu[0] = float("nan")
                    else:
                        cpu[0] += tree1 - tree0
                error = max(error, check(got, want))
            return served_t, eager_t

        served_s, eager_s = alternate(standard, reps, 100)
        served_cpu, eager_cpu = cpu
        # the same p50 pair at a short and a long length: fixed and per-step costs
        lengths: dict[int, tuple[float, float]] = {}
        for n in (short, long):
            served_n, eager_n = alternate(n, max(5, reps // 3), 200)
            lengths[n] = (statistics.median(served_n), statistics.median(eager_n))
        # a steady client's view: blocks of requests, each side back to back (the alternation
        # above leaves the worker idle while the eager loop runs, and each request then finds
        # it asleep), the blocks alternating so that drift still hits both
        steady_served: list[float] = []
        steady_eager: list[float] = []
        for b in range(max(2, reps // BLOCK)):
            block = [inputs(500 + BLOCK * b + i) for i in range(BLOCK)]
            wants = []
            for r in block:
                t0 = time.perf_counter()
                wants.append(eager(r))
                steady_eager.append(time.perf_counter() - t0)
            for r, want in zip(block, wants):
                t0 = time.perf_counter()
                got = server.run(r, walk, timeout=600)
                steady_served.append(time.perf_counter() - t0)
                error = max(error, check(got, want))

        def eager_round(batch: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
            """``batch`` run eagerly one after another: the wall time, the outputs."""
            t0 = time.perf_counter()
            wants = [eager(r) for r in batch]
            return time.perf_counter() - t0, wants

        def served_round(batch: list[dict[str, Any]], wants: list[dict[str, Any]]) -> float:
            """``batch`` served as concurrent requests, each checked against ``wants``: the
            wall time. Concurrent clients: none waits for another's admission (as HTTP
            clients and submit_async); a blocking submit() loop would serialize them."""
            nonlocal error
            t0 = time.perf_counter()
            futures = [server.submit_future(r, walk, stream=False) for r in batch]
            gots = [f.result(timeout=600).result(timeout=600) for f in futures]
            wall = time.perf_counter() - t0
            for got, want in zip(gots, wants):
                error = max(error, check(got, want))
            return wall

        ratios: list[tuple[float, float, float]] = []  # (eager / served, eager, served)
        for k in range(ROUNDS):  # each a new batch, eager then served
            batch = [inputs(1000 + 100 * k + i) for i in range(concurrent)]
            eager_wall, wants = eager_round(batch)
            served_wall = served_round(batch, wants)
            ratios.append((eager_wall / served_wall, eager_wall, served_wall))
        _, eager_wall, served_wall = sorted(ratios)[len(ratios) // 2]  # the median round
        # a loaded server's view: rounds back to back, in blocks of STEADY_ROUNDS each way
        # (alternating a round each way leaves the worker idle through the eager round, so
        # that each served round starts on a cold worker), the blocks alternating
        steady_eager_rounds: list[float] = []
        steady_served_rounds: list[float] = []
        for b in range(2):
            rounds = [
                [inputs(5000 + 1000 * b + 100 * k + i) for i in range(concurrent)]
                for k in range(STEADY_ROUNDS)
            ]
            eager_rounds = [eager_round(batch) for batch in rounds]
            steady_eager_rounds += [wall for wall, _ in eager_rounds]
            for batch, (_, wants) in zip(rounds, eager_rounds):
                steady_served_rounds.append(served_round(batch, wants))
        # the bound batching can reach: the last round's requests as one batch, eagerly
        joint = {
            k: torch.cat([r[k] for r in batch]) if isinstance(v, torch.Tensor) else v
            for k, v in batch[0].items()
        }
        batched: list[float] = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            eager(joint)
            batched.append(time.perf_counter() - t0)
        stats = server.stats()
        sizes = server.batch_sizes
    served, eager_p50 = statistics.median(served_s), statistics.median(eager_s)
    model_points = [(short, lengths[short]), (standard, (served, eager_p50)), (long, lengths[long])]
    batched_s = statistics.median(batched)
    return {
        "walk": walk,
        "device": device,
        "threads": threads,
        "served_p50_s": served,
        "eager_p50_s": eager_p50,
        "served_over_eager": served / eager_p50,
        # each request's served time over the eager run just before it: a slow moment of the
        # VM that lands on one side only moves one pair, where it moves a p50 of one side
        "paired_served_over_eager": statistics.median(s / e for s, e in zip(served_s, eager_s)),
        "steady_served_p50_s": statistics.median(steady_served),
        "steady_eager_p50_s": statistics.median(steady_eager),
        "steady_served_over_eager": statistics.median(steady_served)
        / statistics.median(steady_eager),
        # CPU seconds of the server process and its workers per request over the eager
        # loop's (clock ticks: meaningful over many reps only)
        "cpu_served_over_eager": served_cpu / eager_cpu if eager_cpu > 0 else None,
        "concurrent": concurrent,
        "served_concurrent_req_per_s": concurrent / served_wall,
        "eager_one_by_one_req_per_s": concurrent / eager_wall,
        "throughput_ratio": eager_wall / served_wall,
        # rounds back to back each way (medians of 2 x STEADY_ROUNDS)
        "steady_round_served_s": statistics.median(steady_served_rounds),
        "steady_round_eager_s": statistics.median(steady_eager_rounds),
        "steady_throughput_ratio": statistics.median(steady_eager_rounds)
        / statistics.median(steady_served_rounds),
        # the same requests as one batch through the eager loop: what batching alone gives
        "eager_batched_req_per_s": concurrent / batched_s,
        "batched_throughput_ratio": eager_wall / batched_s,
        "served_over_batched": batched_s / served_wall,
        "overhead": overhead_model(
            [(n, t[0]) for n, t in model_points], [(n, t[1]) for n, t in model_points]
        ),
        "max_rel_error": error,
        "speculated_steps": stats.speculated_steps,
        "wasted_steps": stats.wasted_steps,
        "largest_batch": max(sizes) if sizes else 0,
        # CUDA graphs (``--device cuda``): replays of the served nodes, nodes left eager
        "graph_replays": sum(v for k, v in stats.counters.items() if k.endswith("/graph_replays")),
        "graphs_refused": sum(
            v for k, v in stats.counters.items() if k.endswith("/graphs_refused")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 reps, 8 concurrent")
    parser.add_argument("--full", action="store_true", help="(the default sizes)")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: the served side lowered for CUDA (its capturable nodes replayed "
        "from CUDA graphs), the eager side on the same GPU; writes loops_cuda.json",
    )
    args = parser.parse_args()
    reps, concurrent = (5, 8) if args.quick else (args.reps, 16)
    load = list(os.getloadavg())
    results = {name: bench(name, reps, concurrent, args.device) for name in CASES}
    for name, r in results.items():
        print(
            f"{name:8} batch 1: served {r['served_p50_s'] * 1e3:.2f} ms vs eager "
            f"{r['eager_p50_s'] * 1e3:.2f} ms ({r['served_over_eager']:.2f}x, paired "
            f"{r['paired_served_over_eager']:.2f}x, CPU "
            f"{r['cpu_served_over_eager'] or float('nan'):.2f}x); {concurrent} "
            f"concurrent: {r['throughput_ratio']:.2f}x the eager one-by-one throughput "
            f"(largest batch {r['largest_batch']}, max rel error {r['max_rel_error']:.1e}); "
            f"the same batch eagerly {r['batched_throughput_ratio']:.2f}x (served reaches "
            f"{r['served_over_batched']:.2f} of it)"
        )
        print(
            f"{'':8} back to back (blocks of {BLOCK} each way): served "
            f"{r['steady_served_p50_s'] * 1e3:.2f} ms vs eager "
            f"{r['steady_eager_p50_s'] * 1e3:.2f} ms ({r['steady_served_over_eager']:.2f}x); "
            f"{concurrent} concurrent, rounds back to back (blocks of {STEADY_ROUNDS}): "
            f"{r['steady_throughput_ratio']:.2f}x the eager one-by-one throughput"
        )
        o = r["overhead"]
        reach = o["length_for_1_2x"]
        print(
            f"{'':8} fixed cost per request {o['fixed_overhead_s'] * 1e6:.0f} us over eager, "
            f"per step {o['per_step_overhead_s'] * 1e6:.1f} us over eager's "
            f"{o['eager_per_step_s'] * 1e6:.1f} us; served/eager <= 1.2 from "
            + ("never" if reach is None else f"{reach:.0f} steps")
        )
    out = "loops.json" if args.device == "cpu" else f"loops_{args.device.split(':')[0]}.json"
    write_result(
        ROOT / "benchmarks/results" / out,
        {"benchmark": "loops", "quick": args.quick, "reps": reps, "results": results},
        load,
    )


if __name__ == "__main__":
    main()
