"""HTTP API overhead and admission under load: ``python benchmarks/bench_http.py [--quick]``.

Part 1, overhead: ``--requests`` (200) sequential requests of the default model's ``prefill``
walk (prompt ``[[5, 6, 7]]``, ``max_new_tokens=1``, greedy: one prefill) three ways,
after ``--warmup`` (20) of each:

    python      ``Server.run(inputs, walk="prefill")`` in this process (workers spawned here)
    floor       httpx GET /v1/models (no walk): the round trip of the HTTP stack alone
    walks       httpx POST /v1/walks/prefill (JSON tensors) to a ``walkserve serve`` subprocess
    completions httpx POST /v1/completions, prompt as those ids, max_tokens=1

The HTTP overhead is each route's p50 (p95) minus the Python API's: request parsing,
validation, the event loop and thread-pool hops, JSON encoding and the loopback socket.

Part 2, load: ``--clients`` (200) concurrent streaming clients (asyncio + httpx, 127.0.0.1)
each send one ``stream=true`` completion (``max_tokens=16``) at once to the subprocess started
with ``--max-queued 32``, all bounded by ``--load-timeout`` (120 s). Counts 200s, 503s (and
whether each carried ``Retry-After``) and anything else, and checks that every admitted (200)
stream ended with ``data: [DONE]`` after its finish chunk.

Writes ``benchmarks/results/http.json`` (cpu count, torch version, git commit, load average)
and prints a table. Small shared VMs are noisy: compare numbers from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from walkserve.adapters.hf_causal_lm import GREEDY_INPUTS  # the text walks' sampling inputs
from walkserve.benchmarking import git_commit

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the server and workers

import httpx
import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "http.json"
MODEL = "walkserve-default"
PROMPT = [[5, 6, 7]]

MAX_QUEUED = 32


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in samples_s)
    return {
        "p50_ms": round(ms[len(ms) // 2], 3),
        "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 3),
        "n": len(ms),
    }


# ---------------------------------------------------------------------------- part 1


def python_api(requests: int, warmup: int) -> list[float]:
    from walkserve.runtime.server import serve

    inputs = {"input_ids": torch.tensor(PROMPT), "max_new_tokens": 1, **GREEDY_INPUTS}
    with serve(MODEL) as server:
        times = []
        for i in range(warmup + requests):
            t0 = time.perf_counter()
            server.run(inputs, walk="prefill", timeout=60)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


def http_route(
    url: str, path: str, body: dict[str, Any] | None, requests: int, warmup: int
) -> list[float]:
    """Times of sequential POSTs of ``body`` to ``path`` (GET when ``body`` is None)."""
    times = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(warmup + requests):
            t0 = time.perf_counter()
            r = client.get(path) if body is None else client.post(path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{path} answered {r.status_code}: {r.text}")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------- part 2


async def one_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            data = await r.aread()
            if r.status_code != 200:
                return {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
            events = [e for e in data.decode().split("\n\n") if e.startswith("data: ")]
            finished = any('"finish_reason":"' in e for e in events)
            done = bool(events) and events[-1] == "data: [DONE]"
            return {"status": 200, "completed": finished and done}
    except httpx.HTTPError as e:
        return {"status": f"error: {type(e).__name__}"}


async def load(url: str, clients: int, timeout_s: float) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "load test", "max_tokens": 16, "stream": True}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        tasks = [asyncio.create_task(one_stream(client, body)) for _ in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
    results = [t.result() for t in done]
    ok = [r for r in results if r["status"] == 200]
    busy = [r for r in results if r["status"] == 503]
    return {
        "clients": clients,
        "max_queued": MAX_QUEUED,
        "ok_200": len(ok),
        "busy_503": len(busy),
        "busy_503_with_retry_after": sum(r["retry_after"] is not None for r in busy),
        "other": sorted(str(r["status"]) for r in results if r["status"] not in (200, 503)),
        "unfinished_in_time": len(pending),
        "admitted_completed": sum(bool(r["completed"]) for r in ok),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


# ---------------------------------------------------------------------------- server


def start_server(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "walkserve.cli", "serve", "--port", str(port)]
    cmd += ["--max-queued", str(MAX_QUEUED)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"walkserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("walkserve serve did not become healthy in 180 s")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--load-timeout", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="50 requests, 5 warm-up")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warmup = 50, 5

    load_before = os.getloadavg()
    python = percentiles(python_api(args.requests, args.warmup))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port)
    try:
        floor = percentiles(http_route(url, "/v1/models", None, args.requests, args.warmup))
        walk_body = {"inputs": {"input_ids": PROMPT, "max_new_tokens": 1, **GREEDY_INPUTS}}
        walks = percentiles(
            http_route(url, "/v1/walks/prefill", walk_body, args.requests, args.warmup)
        )
        completion_body = {"model": MODEL, "prompt": PROMPT[0], "max_tokens": 1}
        completions = percentiles(
            http_route(url, "/v1/completions", completion_body, args.requests, args.warmup)
        )
        loaded = asyncio.run(load(url, args.clients, args.load_timeout))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    load_after = os.getloadavg()

    overhead = {
        name: {
            "p50_ms": round(route["p50_ms"] - python["p50_ms"], 3),
            "p95_ms": round(route["p95_ms"] - python["p95_ms"], 3),
        }
        for name, route in (("walks", walks), ("completions", completions))
    }
    result = {
        "benchmark": "http",
        "walk": "prefill, max_new_tokens=1, prompt [[5, 6, 7]]",
        "python_api": python,
        "http_floor_get_models": floor,
        "http_walks": walks,
        "http_completions": completions,
        "overhead_over_python_api": overhead,
        "overhead_target_p50_ms": 3.0,
        "load": loaded,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'way':<28}{'p50 ms':>10}{'p95 ms':>10}{'+p50 ms':>10}{'+p95 ms':>10}")
    print(f"{'Server.run (python)':<28}{python['p50_ms']:>10.2f}{python['p95_ms']:>10.2f}")
    print(f"{'GET /v1/models (no walk)':<28}{floor['p50_ms']:>10.2f}{floor['p95_ms']:>10.2f}")
    for name, route in (("POST /v1/walks/prefill", walks), ("POST /v1/completions", completions)):
        extra = overhead["walks" if "walks" in name else "completions"]
        print(
            f"{name:<28}{route['p50_ms']:>10.2f}{route['p95_ms']:>10.2f}"
            f"{extra['p50_ms']:>10.2f}{extra['p95_ms']:>10.2f}"
        )
    print()
    print(
        f"load: {loaded['clients']} streaming clients, --max-queued {MAX_QUEUED}: "
        f"{loaded['ok_200']} x 200 ({loaded['admitted_completed']} completed), "
        f"{loaded['busy_503']} x 503 ({loaded['busy_503_with_retry_after']} with Retry-After), "
        f"other {loaded['other'] or 'none'}, unfinished {loaded['unfinished_in_time']}, "
        f"{loaded['wall_s']} s"
    )
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, wrote {args.out}")


if __name__ == "__main__":
    main()
