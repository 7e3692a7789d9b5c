"""Mixed workload: text, speech and image requests arriving together at one server, against the
same requests one class at a time: ``python benchmarks/bench_mixed.py [--quick | --full]``.

One ``walkserve serve`` subprocess of ``walkserve-default`` (text, speech and image walks on the
same workers). A seeded open-loop workload (Poisson arrivals at ``--rate``) mixes streamed text
completions, streamed speech and image generations (``--mix``). It runs twice on the same
server after a warm-up of each class:

    mixed   every request at its arrival time
    alone   each class by itself, its requests at the same arrival times they had in the mix

Goodput under explicit service targets (``--slo``; default ``ttft=1,tpot=0.25,image=5,
viability=1``): text meets ``ttft`` (first token) and ``tpot``; speech meets ``ttft`` (first
audio) and ``viability`` (every audio chunk arrives before the audio before it has finished
playing: no audible gap); images meet ``image`` (latency). Reports per class the share of
requests meeting their targets (mixed and alone), p50/p99 of first-output and end-to-end
latency, throughput, and the interference: how much each class's p50 latency grows when the
others share the server. Writes ``benchmarks/results/mixed.json`` and its plot.
``--quick``: 18 requests at 1.5/s; default 60 at 2/s; ``--full`` 120 at 3/s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the server and workers

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("walkserve") is None or importlib.util.find_spec("benchmarks") is None:
    sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from walkserve.benchmarking import machine_info  # noqa: E402

MODEL = "walkserve-default"
CLASSES = ("text", "speech", "image")


def start_server(model: str) -> tuple[subprocess.Popen[str], str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "walkserve.cli", "serve", "--model", model, "--port", str(port)]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the server)
    # the checkout's walkserve, also when it is not installed
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"walkserve serve exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("walkserve serve did not become healthy in 300 s")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def class_block(summary: dict[str, Any], kind: str) -> dict[str, Any]:
    b = summary["by_kind"].get(kind)
    if b is None:
        return {}
    out = {
        "requests": b["requests"],
        "failed": b["failed"],
        "goodput_share": b["goodput"]["share"],
        "first_p50_s": b["first_s"]["p50"],
        "first_p99_s": b["first_s"]["p99"],
        "e2e_p50_s": b["e2e_s"]["p50"],
        "e2e_p99_s": b["e2e_s"]["p99"],
    }
    if "output_tokens_per_s" in b:
        out["tpot_p50_s"] = b["tpot_s"]["p50"]
    if "viable_share" in b:
        out["viable_share"] = b["viable_share"]
        out["rtf_p50"] = b["rtf"]["p50"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="18 requests at 1.5/s")
    size.add_argument("--full", action="store_true", help="120 requests at 3/s")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--mix", default="text=1,speech=1,image=1")
    parser.add_argument("--slo", default="ttft=1,tpot=0.25,image=5,viability=1")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/mixed.json")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rate = 18, 1.5
    if args.full:
        args.requests, args.rate = 120, 3.0
    slo = loadgen.parse_slo(args.slo)
    info = machine_info()
    workload = loadgen.Workload(
        mix=loadgen.Workload.parse_mix(args.mix),
        prompt_len=loadgen.Lengths(8, 32),
        output_len=loadgen.Lengths(16, 48),
        speech_len=loadgen.Lengths(8, 32),
        speech_tokens=loadgen.Lengths(16, 48),
        model=args.model,
        seed=args.seed,
    )
    requests = loadgen.plan(workload, args.requests)
    times = loadgen.arrival_times(len(requests), args.rate, args.burstiness, args.seed)
    kinds = sorted({p.kind for p in requests})
    # one warm-up of each class first: first-call costs stay out of both runs
    warm = loadgen.Workload(**{**workload.__dict__, "seed": args.seed + 1})
    warmups = []
    for kind in kinds:
        sample = next(p for p in loadgen.plan(warm, 50) if p.kind == kind)
        warmups.append(loadgen.Planned(-1, kind, sample.route, sample.body, 0, None, True))

    proc, url, _log = start_server(args.model)
    try:
        print(f"mixed: {len(requests)} requests ({args.mix}) at {args.rate}/s", file=sys.stderr)
        arrivals = loadgen.Arrivals(None, rate=args.rate, burstiness=args.burstiness)
        records, wall = asyncio.run(
            loadgen.run(url, warmups + requests, arrivals, schedule=times, timeout=600)
        )
        mixed = loadgen.summarize(records, wall, slo)
        alone: dict[str, Any] = {}
        for kind in kinds:
            picked = [i for i, p in enumerate(requests) if p.kind == kind]
            t0 = times[picked[0]]
            print(f"alone: {len(picked)} {kind} requests", file=sys.stderr)
            recs, w = asyncio.run(
                loadgen.run(
                    url,
                    [requests[i] for i in picked],
                    arrivals,
                    schedule=[times[i] - t0 for i in picked],
                    timeout=600,
                )
            )
            alone[kind] = loadgen.summarize(recs, w, slo)
    finally:
        stop_server(proc)

    classes = {
        kind: {"mixed": class_block(mixed, kind), "alone": class_block(alone[kind], kind)}
        for kind in kinds
    }
    interference = {}
    for kind, c in classes.items():
        m, a = c["mixed"].get("first_p50_s"), c["alone"].get("first_p50_s")
        if m is not None and a:
            interference[kind] = {"first_p50_ratio": m / a}
        m, a = c["mixed"].get("e2e_p50_s"), c["alone"].get("e2e_p50_s")
        if m is not None and a:
            interference.setdefault(kind, {})["e2e_p50_ratio"] = m / a
    result = {
        "benchmark": "mixed",
        "quick": args.quick,
        "full": args.full,
        "model": args.model,
        "requests": len(requests),
        "rate_per_s": args.rate,
        "burstiness": args.burstiness,
        "mix": args.mix,
        "slo": slo,
        "goodput_share": {
            "mixed": {k: c["mixed"].get("goodput_share") for k, c in classes.items()},
            "alone": {k: c["alone"].get("goodput_share") for k, c in classes.items()},
        },
        "mixed_goodput_overall": mixed["overall"]["goodput"],
        "classes": classes,
        "interference": interference,
        "mixed_summary": mixed,
        "alone_summaries": alone,
        **info,
        "load_average_after": list(os.getloadavg()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'class':<8}{'goodput mixed':>15}{'alone':>8}{'first p50 mixed/alone ms':>28}")
    for kind, c in classes.items():
        m, a = c["mixed"], c["alone"]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{1000 * v:.0f}"

        def share(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        print(
            f"{kind:<8}{share(m.get('goodput_share')):>15}{share(a.get('goodput_share')):>8}"
            f"{ms(m.get('first_p50_s')):>18}/{ms(a.get('first_p50_s'))}"
        )
    from benchmarks.plots import plot_result

    print(f"wrote {args.out} and {plot_result(args.out)}")


if __name__ == "__main__":
    main()
