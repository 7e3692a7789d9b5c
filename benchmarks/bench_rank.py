"""A rank's own cost per request, in one process: ``python benchmarks/bench_rank.py [--quick]``.

The worker's engine loop as it runs in a worker (``EngineLoop`` with the real ``NodeRunner``,
``RankScheduler``, shared-memory transport and reports encoded as messages), with no sockets:
an inbox hands it ``StartRun`` commands as a worker's inbox does (and each request's ``Cancel``
after its exit, as the server sends it), so what is measured is the rank's scheduling,
stepping and reporting around the model, with no process crossing and no other process on the
cores. For ``bench_loops``'s two loops (``loop_models``: a 30-step rollout, a 96-step
recurrent LM streamed into a window decoder), p50 wall time of a batch of requests:

    batch 1       one request at a time
    together      16 requests that reach the rank in one message (one cohort from step 0)
    staggered     16 requests that reach it one per engine pass, as requests admitted one
                  after another do (each arrival joins the running cohort; they end one by one)

each against the same requests as one batch through the eager loop in this process (same torch
threads: 1), run before each of the rank's batches (alternated, so that a change of the host's
speed during the run moves both). Reports the time per request over eager's. Writes
``benchmarks/results/rank.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loop_models

from walkserve.benchmarking import git_commit, write_result

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # factory, walk, inputs(seed, length), length
    "rollout": (loop_models.rollout, "rollout", loop_models.rollout_inputs, 30),
    "speech": (loop_models.speech, "speak", loop_models.speech_inputs, 96),
}
SCENARIOS = {"batch 1": (1, False), "together": (16, False), "staggered": (16, True)}


class Feed:
    """The engine's inbox: the next batch of ``StartRun``s once the last batch is done (all at
    once, or one per ``read`` when ``staggered``), each request's ``Cancel`` after its exit."""

    def __init__(
        self, make: Any, n: int, staggered: bool, batches: int, between: Any = None
    ) -> None:
        self.engine: Any = None  # the loop it feeds, set once made
        self.make, self.n, self.staggered = make, n, staggered
        self.between = between  # run before each batch, outside its time (the eager one)
        self.batches = batches
        self.started = self.done = 0
        self.pending: list[Any] = []
        self.cancels: list[Any] = []  # releases of the requests that exited, not yet read
        self.t0 = 0.0
        self.times: list[float] = []
        self.stopping = threading.Event()

    def ended(self, items: list[int]) -> None:
        """Region runs ``items`` exited: their requests' releases reach the rank at its next
        read, as the server sends each once the pass that saw its exit is over."""
        from walkserve.runtime.rankcommands import CancelRequest

        self.done += len(items)
        self.cancels += [CancelRequest(f"q{i}") for i in items]

    def read(self, wait: bool, within_s: float | None = None) -> None:
        commands, self.cancels = self.cancels, []
        if self.pending:  # the rest of a staggered batch: one per pass
            commands.append(self.pending.pop(0))
        if commands:
            self.engine.put_all(commands)
            return
        if self.done < self.started:
            return
        if self.started:
            self.times.append(time.perf_counter() - self.t0)
        if len(self.times) >= self.batches:
            self.stopping.set()
            return
        if self.between is not None:
            self.between()
        runs = [self.make(self.started + k) for k in range(self.n)]
        self.started += self.n
        self.t0 = time.perf_counter()
        if self.staggered:
            self.pending = runs[1:]
            runs = runs[:1]
        self.engine.put_starts(runs)

    def waiting(self) -> bool:
        return bool(self.pending or self.cancels)


def bench(name: str, batches: int) -> dict[str, Any]:
    from walkserve import capture
    from walkserve.lowering.lower import lower
    from walkserve.runtime import messages as m
    from walkserve.runtime.config import ShmPoolConfig
    from walkserve.runtime.engine import EngineLoop
    from walkserve.runtime.rankcommands import StartRun
    from walkserve.runtime.rankscheduler import RankScheduler
    from walkserve.runtime.regionwalk import region_walks
    from walkserve.runtime.runner import NodeRunner
    from walkserve.runtime.shm import ShmPool
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.transport import ObjectStore, ShmTransport

    factory, walk, inputs, length = CASES[name]
    model, sample = factory()
    captured = capture.trace(model, sample)
    plan = lower(captured, sample)
    (region,) = [r.name for r in plan.regions[walk]]
    reqs = [inputs(seed, length) for seed in range(16)]
    out: dict[str, Any] = {"length": length}
    for scenario, (n, staggered) in SCENARIOS.items():
        runner = NodeRunner(captured, plan, 0)
        scheduler = RankScheduler(
            region_walks(captured, plan, 0), joins=runner.joinable(), max_batch=plan.max_batch
        )
        pool = ShmPool(ShmPoolConfig(when_exhausted="raise"))
        objects = ObjectStore(0)
        transport = ShmTransport(pool, ShmReader(), objects=objects)

        def make(i: int) -> StartRun:
            return StartRun(i, f"q{i}", walk, region, reqs[i % 16], False)

        joint = {
            k: torch.cat([r[k] for r in reqs[:n]]) if isinstance(v, torch.Tensor) else v
            for k, v in reqs[0].items()
        }
        eager: list[float] = []

        def run_eager(joint: dict[str, Any] = joint, eager: list[float] = eager) -> None:
            with torch.no_grad():
                t0 = time.perf_counter()
                getattr(model, walk)(**joint)
                eager.append(time.perf_counter() - t0)

        feed = Feed(make, n, staggered, batches + 3, run_eager)  # 3 warm-up batches

        def send(msg: Any, feed: Feed = feed) -> None:
            m.encode(msg)  # what a worker's send costs before the socket
            if isinstance(msg, m.RegionEvents):
                feed.ended([e.item for e in msg.events if isinstance(e, m.RegionDone)])

        engine = feed.engine = EngineLoop(0, plan, runner, scheduler, transport, objects, send)
        try:
            engine.run(feed.stopping, inbox=feed)
        finally:
            pool.close()
        rank_s, eager_s = statistics.median(feed.times[3:]), statistics.median(eager[3:])
        out[scenario] = {
            "requests": n,
            "rank_p50_s": rank_s,
            "eager_batched_p50_s": eager_s,
            "rank_over_eager": rank_s / eager_s,
            "overhead_per_request_s": (rank_s - eager_s) / n,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 batches per scenario")
    parser.add_argument("--full", action="store_true", help="(the default sizes)")
    parser.add_argument("--batches", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a worker's default on this host
    batches = 10 if args.quick else args.batches
    load = list(os.getloadavg())
    results = {name: bench(name, batches) for name in CASES}
    rows = []
    for name, r in results.items():
        parts = []
        for scenario in SCENARIOS:
            s = r[scenario]
            parts.append(
                f"{scenario} {s['rank_p50_s'] * 1e3:.3g} ms vs eager {s['eager_batched_p50_s'] * 1e3:.3g}"
                f" ms ({s['rank_over_eager']:.2f}x, +{s['overhead_per_request_s'] * 1e6:.0f} us"
                " per request)"
            )
        line = f"{name} ({r['length']} steps): " + "; ".join(parts)
        print(line)
        rows.append(line)
    machine = f"{os.cpu_count()} CPUs, torch {torch.__version__}, @{git_commit()[:7]}"
    write_result(
        ROOT / "benchmarks/results/rank.json",
        {
            "benchmark": "rank",
            "quick": args.quick,
            "batches": batches,
            "results": results,
            "readme_rows": [
                {
                    "benchmark": "a rank's engine loop in one process (no sockets) vs the same"
                    " requests as one eager batch, torch threads 1 (`benchmarks/bench_rank.py`,"
                    " `benchmarks/results/rank.json`)",
                    "machine": machine,
                    "result": "; ".join(rows) + f"; 1-min load {load[0]:.1f} before",
                }
            ],
        },
        load,
    )


if __name__ == "__main__":
    main()
