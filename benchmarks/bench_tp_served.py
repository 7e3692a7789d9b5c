"""Tensor parallelism and replicas served: ``python benchmarks/bench_tp_served.py [--quick]``.

The bench model of ``bench_text.py`` (~35M-parameter Llama, fp32) saved to a temporary
directory and served by ``serve()`` on worker processes, three ways:

    tp1        one rank (torch threads: every core)
    tp2        one TP group of two ranks over gloo (one thread each: the same cores), the
               checkpoint loaded shard by shard, every step broadcast from the leader
    replicas2  two replicas of one rank each (one thread each), requests spread by the batcher

``--requests`` (16) concurrent greedy requests of ``--context`` (64) random prompt tokens and
``--new`` (32) new tokens each, submitted at once after one warm-up request; reports the wall
time until all are done, output tokens per second, the mean decode step time seen by a
request (its wall time over its tokens), and whether every way's tokens equal tp1's. Writes
``benchmarks/results/tp_served.json`` with the load average. The step-level figures (time in
collectives) are ``bench_tp.py``'s; this is what a client of the server sees.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("walkserve") is None or importlib.util.find_spec("benchmarks") is None:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_text import build_model  # noqa: E402
from walkserve.benchmarking import write_result  # noqa: E402

WAYS = {"tp1": (1, 1), "tp2": (2, 1), "replicas2": (1, 2)}  # name -> (tp, replicas)


def requests(n: int, context: int, new: int) -> list[dict[str, Any]]:
    from walkserve.adapters.hf_causal_lm import sample_request

    g = torch.Generator().manual_seed(0)
    return [
        sample_request(torch.randint(2, 8192, (context,), generator=g).tolist(), new)
        for _ in range(n)
    ]


def run_way(path: str, tp: int, replicas: int, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    from walkserve.adapters.registry import capture_model
    from walkserve.lowering.placement import tensor_parallel_placement
    from walkserve.runtime.server import serve

    captured = capture_model(path)
    ranks = tp * replicas
    threads = max(1, (os.cpu_count() or 1) // ranks)
    placement = tensor_parallel_placement(captured, tp, replicas)
    with serve(captured, placement, threads=threads) as server:
        server.run(reqs[0])  # warm-up
        start = time.perf_counter()
        handles = [(server.submit(r), time.perf_counter()) for r in reqs]
        tokens, steps = [], []
        for h, sent in handles:
            out = h.result(timeout=1800)
            got = [int(out["token"]), *out["tokens"][0].tolist()]
            steps.append((time.perf_counter() - sent) / len(got))
            tokens.append(got)
        wall = time.perf_counter() - start
        per_rank = dict(server.batcher.per_rank)
        items = dict(server.batcher.items_per_rank)
    total = sum(len(t) for t in tokens)
    return {
        "tp": tp,
        "replicas": replicas,
        "threads_per_rank": threads,
        "wall_s": wall,
        "output_tokens_per_s": total / wall,
        "mean_ms_per_token_per_request": 1000 * sum(steps) / len(steps),
        "batches_per_rank": per_rank,  # node batches and region starts
        "items_per_rank": items,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "tp_served.json"
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new = 8, 16
    load_before = list(os.getloadavg())
    reqs = requests(args.requests, args.context, args.new)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        for name, (tp, replicas) in WAYS.items():
            runs[name] = run_way(tmp, tp, replicas, reqs)
            print(name, {k: v for k, v in runs[name].items() if k != "tokens"}, flush=True)
    base = runs["tp1"]
    summary = {
        "benchmark": "tensor parallelism and replicas served (CPU, gloo)",
        "model": "bench_text Llama ~35M fp32 (hidden 512, 8 layers, 8 heads, 4 KV heads)",
        "requests": args.requests,
        "context": args.context,
        "new_tokens": args.new,
        "ways": {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in runs.items()},
        "wall_ratio_over_tp1": {name: r["wall_s"] / base["wall_s"] for name, r in runs.items()},
        "tokens_equal_tp1": {name: r["tokens"] == base["tokens"] for name, r in runs.items()},
    }
    ways = summary["ways"]
    cells = [
        f"{name} {w['output_tokens_per_s']:.0f} tok/s ({summary['wall_ratio_over_tp1'][name]:.2f}x "
        f"tp1's wall time)"
        for name, w in ways.items()
    ]
    equal = all(summary["tokens_equal_tp1"].values())
    load = ", ".join(f"{x:.1f}" for x in load_before)
    summary["readme_rows"] = [
        {
            "benchmark": f"TP=2 and 2 replicas served vs one rank, {args.requests} concurrent "
            f"greedy requests of {args.context}+{args.new} tokens, bench model "
            "(`benchmarks/bench_tp_served.py`, `benchmarks/results/tp_served.json`)",
            "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, load {load}",
            "result": "; ".join(cells) + f"; tokens equal tp1's: {equal}",
        }
    ]
    write_result(args.out, summary, load_before)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
