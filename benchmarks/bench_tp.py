"""Tensor parallelism on CPU: ``python benchmarks/bench_tp.py [--quick]``.

The bench model of ``bench_text.py`` (~35M-parameter Llama: hidden 512, 8 layers, 8 heads, 4
KV heads, vocab 8192, fp32), saved to a temporary directory. ``--batch`` (32) requests with
``--context`` (128) random prompt tokens are prefilled, then ``--steps`` (16) greedy decode
steps of all of them at once are timed, each one ``PagedLM.forward_batch`` packed call:

    tp1     one process, the whole model (torch threads: every core, and also one)
    tp2     two processes joined over gloo (one torch thread each: the same cores), the model
            loaded shard by shard (``runtime.tp.shard``), each step a ``TPRunner.run`` from
            the leader (the batch broadcast to the follower, then both forward); its steps are
            timed without the profiler, then run again under it to count the collectives

Reports the median decode step time of each, the ratio tp2 / tp1, and, at TP=2, the time per
step spent in collectives, from the profiler's gloo events on the leader: the model's
(all-reduce after row-parallel layers, vocabulary-parallel embedding; all-gather of the
logits) and the runner's control broadcast. Also checks that tp2's tokens equal tp1's. Each
method runs in a fresh process. Writes ``benchmarks/results/tp.json`` with the load average.
No speed target on a 2-core machine: the point is correctness and the measured overhead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("walkserve") is None or importlib.util.find_spec("benchmarks") is None:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_text import build_model  # noqa: E402
from walkserve.benchmarking import write_result  # noqa: E402


def prompts(batch: int, context: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 8192, (context,), generator=g).tolist() for _ in range(batch)]


def decode(batch: Any, work: list[list[int]], steps: int, profile: bool) -> dict[str, Any]:
    """Prefill every prompt (one packed call), then ``steps`` timed decode steps of all."""
    out = batch([((torch.tensor([p]), None), {}) for p in work])
    caches = [c for _, c in out]
    tokens = [[int(t[0, 0])] for t, _ in out]
    times: list[float] = []
    collectives: dict[str, float] = defaultdict(float)
    prof = torch.profiler.profile() if profile else None
    if prof is not None:
        prof.__enter__()
    for _ in range(steps):
        calls = [((torch.tensor([[t[-1]]]), c), {"step": len(t)}) for t, c in zip(tokens, caches)]
        start = time.perf_counter()
        out = batch(calls)
        times.append(time.perf_counter() - start)
        for t, (token, _) in zip(tokens, out):
            t.append(int(token[0, 0]))
    if prof is not None:
        prof.__exit__(None, None, None)
        for event in prof.events():
            if event.name.startswith("gloo:"):
                collectives[event.name] += event.cpu_time_total / 1e6  # seconds
    return {"times": times, "tokens": tokens, "collectives": dict(collectives)}


def run_tp1(model_dir: str, args: Any, threads: int, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from walkserve.runtime.kv import hf
    from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

    torch.set_num_threads(threads)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=hf.register())
    paged = PagedLM(lm.eval(), PagedLMConfig(pool_tokens=args.batch * (args.context + 64)))
    decode(paged.forward_batch, prompts(2, 8), 2, profile=False)  # warm-up
    result = decode(paged.forward_batch, prompts(args.batch, args.context), args.steps, False)
    Path(out).write_text(json.dumps(result))


def run_tp2_rank(setup: Any, model_dir: str, args: Any, out: str) -> None:
    from walkserve.runtime.kv import hf
    from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig
    from walkserve.runtime.tp.group import TPGroup
    from walkserve.runtime.tp.runner import TPRunner
    from walkserve.runtime.tp.shard import load_sharded

    torch.set_num_threads(1)
    with TPGroup.join(setup) as group:
        lm = load_sharded(model_dir, group, attn_implementation=hf.register())
        config = PagedLMConfig(pool_tokens=args.batch * (args.context + 64))
        runner = TPRunner(group, PagedLM(lm, config))
        if not group.is_leader:
            runner.follow()
            return
        decode(runner.run, prompts(2, 8), 2, profile=False)  # warm-up
        work = prompts(args.batch, args.context)
        result = decode(runner.run, work, args.steps, profile=False)  # the timed run
        profiled = decode(runner.run, work, args.steps, profile=True)  # its collectives
        result["collectives"] = profiled["collectives"]
        runner.close()
        Path(out).write_text(json.dumps(result))


def run_tp2(model_dir: str, args: Any, out: str) -> None:
    from walkserve.runtime.tp.group import Rendezvous, TPGroupSpec

    spec = TPGroupSpec((0, 1))
    ctx = mp.get_context("spawn")
    with Rendezvous.tcp(timeout_s=600) as rdv:
        procs = [
            ctx.Process(
                target=run_tp2_rank,
                args=(rdv.setup(spec, rank, timeout_s=600), model_dir, args, out),
            )
            for rank in spec.ranks
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"TP=2 ranks exited with {[p.exitcode for p in procs]}")


def fresh(target: Any, *args: Any) -> None:
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    p.join()
    if p.exitcode:
        raise RuntimeError(f"{target.__name__} exited with {p.exitcode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="8 decode steps")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tp.json")
    args = parser.parse_args()
    if args.quick:
        args.steps = 8
    load_before = list(os.getloadavg())
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        build_model(Path(model_dir))
        runs: dict[str, dict[str, Any]] = {}
        for name, threads in ((f"tp1_{cores}threads", cores), ("tp1_1thread", 1)):
            out = str(Path(tmp) / f"{name}.json")
            fresh(run_tp1, model_dir, args, threads, out)
            runs[name] = json.loads(Path(out).read_text())
        out = str(Path(tmp) / "tp2.json")
        run_tp2(model_dir, args, out)
        runs["tp2"] = json.loads(Path(out).read_text())
    step = {name: statistics.median(r["times"]) for name, r in runs.items()}
    tp2 = runs["tp2"]
    control = tp2["collectives"].get("gloo:broadcast", 0.0) / args.steps
    model = sum(v for k, v in tp2["collectives"].items() if k != "gloo:broadcast") / args.steps
    base = f"tp1_{cores}threads"
    summary = {
        "benchmark": "tensor parallel decode step (CPU, gloo)",
        "model": "bench_text Llama ~35M fp32 (hidden 512, 8 layers, 8 heads, 4 KV heads)",
        "batch": args.batch,
        "context": args.context,
        "decode_steps": args.steps,
        "step_ms": {name: 1000 * s for name, s in step.items()},
        "ratio_tp2_over_tp1": step["tp2"] / step[base],
        "ratio_tp2_over_tp1_1thread": step["tp2"] / step["tp1_1thread"],
        "tp2_collectives_ms_per_step": {
            "model": 1000 * model,
            "control_broadcast": 1000 * control,
            "by_event": {k: 1000 * v / args.steps for k, v in tp2["collectives"].items()},
        },
        "tp2_collective_share_of_step": (model + control) / step["tp2"],
        "tokens_equal": all(r["tokens"] == runs[base]["tokens"] for r in runs.values()),
    }
    write_result(args.out, summary, load_before)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
