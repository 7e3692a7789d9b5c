"""Janus image generation, served vs upstream: ``python benchmarks/bench_janus.py [--quick]``.

A random-weight Janus (``walkserve.adapters.janus:small``: text model hidden 512, 8 layers, 8
heads, 4 KV heads, 128x128 images of 64 image tokens, fp32; ``--quick``: the tiny test model,
64x64 images of 16 tokens), CFG with guidance 5, seeded sampling, prompts of 3..8 tokens.
Two ways, each timed with the VQ decode included:

    served     serve("walkserve.adapters.janus:<model>") on one worker process: both guidance
               contexts of every in-flight request are labels over one paged KV pool, packed
               into one forward per step. Latency: ``--latency-requests`` requests one after
               another (concurrency 1); throughput: ``--requests`` requests kept 4 in flight.
    upstream   JanusForConditionalGeneration.generate(generation_mode="image") plus
               decode_image_tokens, one request per call (torch.manual_seed(seed) first), in a
               fresh process; its images/s is requests / total time.

Reports latency p50/p95 at concurrency 1, images/s at concurrency 4 and the ratio to upstream,
and how many served requests produced upstream's image tokens exactly. Writes
``benchmarks/results/image_janus.json`` (cpu count, torch version, git commit, load average).
Small shared VMs are noisy (+-20% or worse): compare ratios from one run.
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
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from walkserve.benchmarking import write_result

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 4


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids between BOS and BOI, sampling seed) per request."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 9, (1,), generator=g))
        out.append((torch.randint(3, 259, (length,), generator=g).tolist(), 1000 + i))
    return out


def inputs(prompt: list[int], seed: int) -> dict[str, torch.Tensor]:
    from walkserve.adapters import janus

    return {"input_ids": janus.sample_inputs(prompt)["input_ids"], "seed": torch.tensor([seed])}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_served(model: str, latency_work: list, work: list) -> dict[str, Any]:
    from walkserve.runtime.server import serve

    with serve(f"walkserve.adapters.janus:{model}") as server:
        server.submit(inputs([5, 6, 7], 1), "generate").result(timeout=600)  # warm-up
        latencies = []
        for prompt, seed in latency_work:
            start = time.perf_counter()
            server.submit(inputs(prompt, seed), "generate").result(timeout=600)
            latencies.append(time.perf_counter() - start)
        tokens: list[list[int]] = []
        start = time.perf_counter()
        pending = [server.submit(inputs(p, s), "generate") for p, s in work[:CONCURRENCY]]
        next_i = len(pending)
        while pending:
            out = pending.pop(0).result(timeout=600)
            tokens.append(out["image_tokens"][0].tolist())
            if next_i < len(work):
                pending.append(server.submit(inputs(*work[next_i]), "generate"))
                next_i += 1
        seconds = time.perf_counter() - start
        usage = server.submit({"probe": torch.zeros(1)}, "pool_usage").result(timeout=60)
    return {
        "latency_s": latencies,
        "throughput_seconds": seconds,
        "tokens": tokens,
        "pages_in_use_after": int(usage["usage"][0, 0]),
        "max_batch": max(server.batch_sizes),
    }


def run_upstream(model: str, latency_work: list, work: list) -> dict[str, Any]:
    from transformers import GenerationConfig

    from walkserve.adapters import janus

    ref = janus.random_janus(janus.SMALL if model == "small" else janus.TINY)
    config = GenerationConfig(
        bos_token_id=janus.TINY_IDS.bos,
        pad_token_id=janus.TINY_IDS.pad,
        do_sample=True,
        guidance_scale=5.0,
        top_k=50,
        generation_kwargs={"boi_token_id": janus.TINY_IDS.boi},
    )

    def one(prompt: list[int], seed: int) -> list[int]:
        ids = inputs(prompt, seed)["input_ids"]
        torch.manual_seed(seed)
        with torch.no_grad():
            tokens = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_mode="image",
                generation_config=config,
            )
            ref.decode_image_tokens(tokens)
        return tokens[0].tolist()  # type: ignore[no-any-return]

    one([5, 6, 7], 1)  # warm-up
    latencies = []
    for prompt, seed in latency_work:
        start = time.perf_counter()
        one(prompt, seed)
        latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    tokens = [one(p, s) for p, s in work]
    return {
        "latency_s": latencies,
        "throughput_seconds": time.perf_counter() - start,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 + 8 requests")
    parser.add_argument("--latency-requests", type=int, default=6)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/image_janus.json")
    parser.add_argument("--method", choices=("upstream",), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="small", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.model, args.latency_requests, args.requests = "tiny", 4, 8
    latency_work = workload(args.latency_requests, args.seed)
    work = workload(args.requests, args.seed + 1)
    if args.method:
        print(json.dumps(run_upstream(args.model, latency_work, work)))
        return

    load_before = os.getloadavg()
    cmd = [sys.executable, __file__, "--method", "upstream", "--model", args.model]
    cmd += ["--latency-requests", str(args.latency_requests), "--requests", str(args.requests)]
    cmd += ["--seed", str(args.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    results = {"upstream": json.loads(proc.stdout.strip().splitlines()[-1])}
    results["served"] = run_served(args.model, latency_work, work)
    matches = sum(
        a == b for a, b in zip(results["served"]["tokens"], results["upstream"]["tokens"])
    )
    for name, r in results.items():
        del r["tokens"]
        r["latency_p50_s"] = statistics.median(r["latency_s"])
        r["latency_p95_s"] = percentile(r["latency_s"], 0.95)
        r["images_per_s"] = args.requests / r["throughput_seconds"]
        print(
            f"{name:>9}: latency p50 {r['latency_p50_s']:.3f} s, p95 {r['latency_p95_s']:.3f} s;"
            f" {r['images_per_s']:.2f} images/s"
        )
    served, upstream = results["served"], results["upstream"]
    summary = {
        "benchmark": "image_janus",
        "quick": args.quick,
        "model": f"walkserve.adapters.janus:{args.model}",
        "latency_requests": args.latency_requests,
        "requests": args.requests,
        "concurrency": CONCURRENCY,
        "results": results,
        "images_per_s_served_vs_upstream": served["images_per_s"] / upstream["images_per_s"],
        "latency_p50_served_vs_upstream": served["latency_p50_s"] / upstream["latency_p50_s"],
        "served_tokens_equal_upstream": f"{matches}/{args.requests}",
    }
    write_result(args.out, summary, load_before)
    print(
        f"served / upstream: {summary['images_per_s_served_vs_upstream']:.2f}x images/s at "
        f"concurrency {CONCURRENCY}, p50 latency ratio {summary['latency_p50_served_vs_upstream']:.2f};"
        f" tokens equal upstream: {matches}/{args.requests}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
