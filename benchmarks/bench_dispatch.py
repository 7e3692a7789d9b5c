"""Per-node dispatch cost, in process and across processes: ``python benchmarks/bench_dispatch.py``.

The node is trivial, so only dispatch is timed: the ``echo`` walk of the model below is an
identity component (``ident``) followed by an identity glue op (``x.contiguous()`` of a
contiguous tensor, with ``glue="separate"`` its own node). One call carries one request's
[1, 16] float32 tensor (inline in the message).

    in process      bare Python call fn(x) vs BatchedComponent([([x], {})]) and
                    NodeRunner.run (a glue node through Interpreter.op; a component node)
    cross process   WorkerPool.submit_batch(...).result(): conductor -> worker -> conductor,
                    typed messages over the rank's link (a Unix socket, ``ranklink``); a
                    1-rank pool; ``_zmq``: the same over ZeroMQ (``rank_links=False``)
    floor           the same round trip with nothing but ZeroMQ: a spawned process echoing
                    bytes on a DEALER, and the same with a receive thread + queue in it
    memory          VmRSS (/proc/<pid>/status) of an idle worker with example-cfg-image
                    loaded, minus the model's weight bytes; a bare `import torch` process for
                    comparison

p50/p95 over ``--calls`` (2000) calls after ``--warmup`` (200). Writes
``benchmarks/results/dispatch.json`` (cpu count, torch version, git commit, load average) and
prints the ratios. Targets: in process <= 50 us p50, cross process <= 300 us p50, idle worker
RSS beyond weights <= 400 MB. The machine's load matters on small hosts: the results record
the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from walkserve.benchmarking import git_commit

# Idle OpenMP threads sleep instead of spinning (set before torch loads; inherited by workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import zmq
from torch import nn

if importlib.util.find_spec("walkserve") is None:
    # Run as a script from a checkout without `pip install -e .`: import the checkout.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from walkserve import capture
from walkserve.adapters.registry import load_model
from walkserve.capture.api import component, walk
from walkserve.lowering.callables import build_callables
from walkserve.lowering.lower import lower
from walkserve.runtime.config import PoolConfig
from walkserve.runtime.pool import WorkerPool
from walkserve.runtime.runner import NodeRunner, RunItem

RESULTS = Path(__file__).parent / "results" / "dispatch.json"
TARGETS = {"in_process_p50_us": 50.0, "cross_process_p50_us": 300.0, "idle_rss_mb": 400.0}
ECHO_MODEL = "bench_dispatch:echo_model"  # importable in the workers: spawn keeps sys.path


@component(engine="stateless")
class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Echo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ident = Identity()

    @walk
    def echo(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.ident(x).contiguous()}


def echo_model() -> tuple[nn.Module, dict[str, Any]]:
    return Echo().eval(), {"x": torch.ones(1, 16)}


# ------------------------------------------------------------------------------ timing


def percentiles(fn: Callable[[], object], calls: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    samples.sort()
    return {
        "p50_us": samples[len(samples) // 2] / 1e3,
        "p95_us": samples[int(len(samples) * 0.95)] / 1e3,
    }


def in_process(calls: int, warmup: int) -> dict[str, dict[str, float]]:
    model, sample = echo_model()
    captured = capture.trace(model, sample)
    plan = lower(captured, sample, glue="separate", check_capture=False)
    batched = build_callables(captured, plan)["echo:ident"]
    x = sample["x"]
    executor = NodeRunner(captured, plan, 0)
    ident = RunItem(0, ("ident",), {"x": x}, ("ident",))
    glue = RunItem(1, ("contiguous",), {"ident": x}, ("contiguous",))

    def bare(v: torch.Tensor) -> torch.Tensor:
        return v

    with torch.no_grad():
        return {
            "bare_call": percentiles(lambda: bare(x), calls, warmup),
            "bare_glue_op": percentiles(lambda: x.contiguous(), calls, warmup),
            "batched_component": percentiles(lambda: batched([([x], {})]), calls, warmup),
            "executor_component": percentiles(
                lambda: executor.run("echo", "ident", [ident]), calls, warmup
            ),
            "executor_glue": percentiles(
                lambda: executor.run("echo", "contiguous", [glue]), calls, warmup
            ),
        }


def cross_process(calls: int, warmup: int) -> dict[str, dict[str, float]]:
    model, sample = echo_model()
    captured = capture.trace(model, sample)
    plan = lower(captured, sample, glue="separate", check_capture=False)
    x = sample["x"]
    out = {}
    for links in (True, False):  # the rank's link (the default), or ZeroMQ's sockets
        config = PoolConfig(rank_links=links)
        with WorkerPool(ECHO_MODEL, 0, captured, plan, 1, threads=1, config=config) as pool:
            for node, name in (("contiguous", "ident"), ("ident", "x")):
                items = [(0, "r", {name: x})]
                out[f"pool_{node}" + ("" if links else "_zmq")] = percentiles(
                    lambda n=node, i=items: pool.submit_batch(0, "echo", n, i).result(),  # type: ignore[misc]
                    calls,
                    warmup,
                )
    return out


# ------------------------------------------------------------------------- zmq floor


def _echo_main(address: str, threaded: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"ready")
    if not threaded:
        while (msg := sock.recv()) != b"stop":
            sock.send(msg)
    else:  # the worker's shape: a receive thread hands messages to the main thread
        jobs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        lock = threading.Lock()

        def receive() -> None:
            while True:
                msg = sock.recv()
                jobs.put(msg)
                if msg == b"stop":
                    return

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        out = ctx.socket(zmq.DEALER)
        out.connect(address)
        while (msg := jobs.get()) != b"stop":
            with lock:
                out.send(msg)
        out.close()
        t.join()
    sock.close()
    ctx.term()


def zmq_floor(calls: int, warmup: int) -> dict[str, dict[str, float]]:
    out = {}
    with tempfile.TemporaryDirectory(prefix="walkserve-bench-") as tmp:
        for threaded in (False, True):
            ctx = zmq.Context()
            router = ctx.socket(zmq.ROUTER)
            address = f"ipc://{tmp}/floor-{int(threaded)}"
            router.bind(address)
            proc = mp.get_context("spawn").Process(target=_echo_main, args=(address, threaded))
            proc.start()
            ident = router.recv_multipart()[0]  # "ready", from the receiving socket

            def round_trip(ident: bytes = ident, router: zmq.Socket[bytes] = router) -> None:
                router.send_multipart([ident, b"x" * 64])
                router.recv_multipart()

            label = "zmq_threaded" if threaded else "zmq_direct"
            out[label] = percentiles(round_trip, calls, warmup)
            router.send_multipart([ident, b"stop"])
            proc.join(10)
            router.close(linger=0)
            ctx.term()
    return out


# ---------------------------------------------------------------------------- memory


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _torch_only(conn: Any) -> None:
    import torch as _torch  # noqa: F401

    conn.send_bytes(str(rss_bytes(os.getpid())).encode())


def memory() -> dict[str, float]:
    name = "example-cfg-image"
    model, sample = load_model(name, 0)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    captured = capture.trace(model, sample)
    plan = lower(captured, sample, check_capture=False)
    with WorkerPool(name, 0, captured, plan, 1, threads=1, config=PoolConfig()) as pool:
        pid = pool.pid(0)
        assert pid is not None
        idle_start = rss_bytes(pid)
        ids = sample["prompt_ids"]
        for _ in range(50):
            pool.submit_batch(
                0, "generate", "text_encoder", [(0, "r", {"prompt_ids": ids})]
            ).result()
        time.sleep(0.5)
        idle_served = rss_bytes(pid)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_torch_only, args=(child,))
    proc.start()
    torch_only = int(parent.recv_bytes())
    proc.join(10)
    mb = 1e6
    return {
        "model": name,  # type: ignore[dict-item]
        "weights_mb": weights / mb,
        "worker_rss_idle_mb": idle_start / mb,
        "worker_rss_after_50_batches_mb": idle_served / mb,
        "worker_rss_beyond_weights_mb": (max(idle_start, idle_served) - weights) / mb,
        "python_import_torch_rss_mb": torch_only / mb,
    }


# ---------------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    load_before = os.getloadavg()
    inproc = in_process(args.calls, args.warmup)
    cross = cross_process(args.calls, args.warmup)
    floor = zmq_floor(args.calls, args.warmup)
    mem = memory()
    load_after = os.getloadavg()

    bare = inproc["bare_call"]["p50_us"]
    in_p50 = max(inproc["executor_glue"]["p50_us"], inproc["batched_component"]["p50_us"])
    cross_p50 = cross["pool_contiguous"]["p50_us"]
    result = {
        "benchmark": "per-node dispatch of a trivial node, in process and across processes",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "calls": args.calls,
        "warmup": args.warmup,
        "in_process": inproc,
        "cross_process": cross,
        "zmq_floor": floor,
        "memory": mem,
        "ratios": {
            "batched_component_vs_bare_call": inproc["batched_component"]["p50_us"] / bare,
            "executor_glue_vs_bare_call": inproc["executor_glue"]["p50_us"] / bare,
            "cross_process_vs_in_process_glue": cross_p50 / inproc["executor_glue"]["p50_us"],
            "cross_process_vs_zmq_direct": cross_p50 / floor["zmq_direct"]["p50_us"],
        },
        "targets": TARGETS,
        "met": {
            "in_process_p50_us": in_p50 <= TARGETS["in_process_p50_us"],
            "cross_process_p50_us": cross_p50 <= TARGETS["cross_process_p50_us"],
            "idle_rss_mb": mem["worker_rss_beyond_weights_mb"] <= TARGETS["idle_rss_mb"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}, {os.cpu_count()} CPUs")
    print(f"{'':24} {'p50 us':>10} {'p95 us':>10}")
    for section in (inproc, cross, floor):
        for label, row in section.items():
            print(f"{label:24} {row['p50_us']:10.1f} {row['p95_us']:10.1f}")
    for label, ratio in result["ratios"].items():  # type: ignore[attr-defined]
        print(f"{label:40} {ratio:8.1f}x")
    for label, value in mem.items():
        print(f"{label:40} {value if isinstance(value, str) else f'{value:8.1f}'}")
    for label, ok in result["met"].items():  # type: ignore[attr-defined]
        print(f"target {label} <= {TARGETS[label]:.0f}: {'met' if ok else 'NOT met'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
