"""Soak: mixed traffic with random cancels and a worker SIGKILLed every ``--kill-every``
seconds, for ``--duration`` seconds: ``python benchmarks/bench_soak.py [--duration 1800]``.

One server (``serve("walkserve-default")``, the Python API, in this process: its counters are
read directly) takes text (``prefill``: a prompt and a decode loop), speech (``speak``) and
image (``generate``) requests from ``--concurrency`` client threads; each request is cancelled
after a random short wait with probability ``--cancel``. A killer thread SIGKILLs rank 0 every
``--kill-every`` seconds (the pool restarts it, ``runtime.supervisor``) and times its return.
Every ``--sample-every`` seconds a sampler records the RSS of this process and of every
worker, the live values (``Server.stats``), the KV pages in use and the shared-memory slots
in use.

The report (``benchmarks/results/soak.json``): every request accounted for (ok, failed by a
kill, cancelled, failed otherwise, unanswered: must be 0), the restart times, each series'
least-squares slope per hour over the run after its first tenth (RSS of a worker is fitted
per incarnation: a restarted one starts small), and the state at the end, once traffic stops
(0 live values, 0 KV pages, 0 slots in use expected).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the workers

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.benchmarking import machine_info  # noqa: E402
from walkserve.runtime.config import PoolConfig  # noqa: E402
from walkserve.runtime.server import RequestFailed, Server, serve  # noqa: E402

MODEL = "walkserve-default"
WALKS = ("prefill", "speak", "generate")


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None for fewer than 3."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 3600 * sum((t - mt) * (v - mv) for t, v in points) / var


class Soak:
    def __init__(self, server: Server, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        graph = server.captured.graph
        sample = server.captured.sample_inputs
        self.inputs = {
            w: {i.name: sample[i.name] for i in graph.walks[w].inputs if i.name in sample}
            for w in WALKS
        }
        self.counts: dict[str, int] = {
            "ok": 0,
            "failed_by_kill": 0,
            "cancelled": 0,
            "failed_other": 0,
            "unanswered": 0,
        }
        self.errors: list[str] = []
        self.restarts: list[float] = []  # seconds from SIGKILL to ready
        self.samples: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.machine = machine_info()  # at the start: the commit that runs

    def request(self, rng: random.Random) -> dict[str, Any]:
        walk = rng.choice(WALKS)
        r = dict(self.inputs[walk])
        if walk == "prefill":
            r["input_ids"] = torch.randint(3, 200, (1, rng.randint(2, 24)))
            r["max_new_tokens"] = rng.randint(2, 48)
        elif walk == "speak":
            r["prompt_ids"] = torch.randint(2, 60, (1, rng.randint(2, 6)))
            r["max_new_tokens"] = rng.randint(2, 12)
        else:
            r["noise"] = torch.randn(r["noise"].shape)
        return {"walk": walk, "inputs": r}

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            req = self.request(rng)
            outcome = self.one(req, rng)
            with self.lock:
                self.counts[outcome] += 1

    def one(self, req: dict[str, Any], rng: random.Random) -> str:
        try:
            handle = self.server.submit(req["inputs"], req["walk"], stream=False)
        except RuntimeError as e:  # refused (a rank failed for good): say so
            self.note(f"refused: {e}")
            time.sleep(0.5)
            return "failed_other"
        cancel = rng.random() < self.args.cancel
        try:
            if cancel:
                time.sleep(rng.uniform(0, 0.2))
                handle.cancel()
            handle.result(timeout=self.args.request_timeout)
            return "ok"
        except TimeoutError:
            self.note(f"unanswered after {self.args.request_timeout} s: {req['walk']}")
            handle.cancel()
            return "unanswered"
        except RequestFailed as e:
            if "cancelled" in str(e):
                return "cancelled"
            if "killed by SIGKILL" in str(e) or "died" in str(e):
                return "failed_by_kill"
            self.note(str(e))
            return "failed_other"

    def note(self, error: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append(error)

    def killer(self) -> None:
        while not self.stop.wait(self.args.kill_every):
            pid = self.server.pool.pid(0)
            before = self.server.health()[0].restarts
            if pid is None:
                continue
            os.kill(pid, signal.SIGKILL)
            t = time.monotonic()
            while not self.stop.is_set():
                h = self.server.health()[0]
                if h.status == "ready" and h.restarts > before:
                    self.restarts.append(time.monotonic() - t)
                    break
                if h.status == "failed":
                    self.note(f"rank 0 failed: {h.error}")
                    return
                time.sleep(0.05)

    def sample(self) -> dict[str, Any]:
        stats = self.server.stats(timeout=10)
        kv = self.server.kv_stats()
        rss = {"server": psutil.Process().memory_info().rss}
        for rank, h in self.server.health().items():
            if h.pid is not None and h.status == "ready":
                with contextlib.suppress(psutil.NoSuchProcess):
                    rss[f"rank{rank}:g{h.restarts}"] = psutil.Process(h.pid).memory_info().rss
        return {
            "t": time.monotonic() - self.t0,
            "rss": rss,
            "live_values": stats.live_values,
            "live_requests": stats.live_requests,
            "kv_pages_in_use": sum(k.pages_in_use for ks in kv.values() for k in ks),
            "shm_in_use": self.server.pool.shm_stats().in_use,
        }

    def sampler(self) -> None:
        while not self.stop.wait(self.args.sample_every):
            try:
                self.samples.append(self.sample())
            except Exception as e:  # a stats query during a restart: try again next time
                self.note(f"sample: {type(e).__name__}: {e}")

    def run(self) -> dict[str, Any]:
        threads = [
            threading.Thread(target=self.client, args=(i,), daemon=True)
            for i in range(self.args.concurrency)
        ]
        threads += [
            threading.Thread(target=self.killer, daemon=True),
            threading.Thread(target=self.sampler, daemon=True),
        ]
        for t in threads:
            t.start()
        self.stop.wait(self.args.duration)
        self.stop.set()
        for t in threads:
            t.join(self.args.request_timeout + 10)
        deadline = time.monotonic() + 30  # traffic stopped: everything is released
        while time.monotonic() < deadline:
            end = self.sample()
            if end["live_values"] == 0 and end["kv_pages_in_use"] == 0 and end["shm_in_use"] == 0:
                break
            time.sleep(0.2)
        return self.report(end)

    def report(self, end: dict[str, Any]) -> dict[str, Any]:
        skip = self.args.duration / 10
        kept = [s for s in self.samples if s["t"] >= skip]
        series: dict[str, list[tuple[float, float]]] = {}
        for s in kept:
            for name, value in s["rss"].items():
                series.setdefault(f"rss_mib:{name}", []).append((s["t"], value / 2**20))
            for name in ("live_values", "kv_pages_in_use", "shm_in_use"):
                series.setdefault(name, []).append((s["t"], s[name]))
        slopes = {name: slope_per_hour(points) for name, points in series.items()}
        means = {name: sum(v for _, v in p) / len(p) for name, p in series.items() if p}
        return {
            "model": MODEL,
            "args": vars(self.args),
            "machine": dict(self.machine, load_average_end=machine_info()["load_average"]),
            "requests": dict(self.counts, total=sum(self.counts.values())),
            "restart_s": self.restarts,
            "slope_per_hour": slopes,
            "mean": means,
            "end": end,
            "samples": self.samples,
            "errors": self.errors,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=1800.0)
    p.add_argument("--kill-every", type=float, default=300.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--cancel", type=float, default=0.1)
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = p.parse_args(argv)
    captured = capture_model(MODEL)
    with serve(captured, pool_config=PoolConfig(heartbeat_s=0.5)) as server:
        report = Soak(server, args).run()
    Path(args.out).write_text(json.dumps(report, indent=1))
    summary = {k: report[k] for k in ("requests", "restart_s", "slope_per_hour", "end")}
    print(json.dumps(summary, indent=1))
    ok = report["requests"]["unanswered"] == 0 and report["end"]["live_values"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
