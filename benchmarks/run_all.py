"""Every benchmark, then the plots and the README table: ``python benchmarks/run_all.py
[--full] [--budget SECONDS] [--readme README.md] [--only a,b]`` (``make bench``).

Discovers ``benchmarks/bench_*.py`` (adapter benchmarks added later are picked up by name),
runs each in its own subprocess with ``--quick`` (or ``--full``; a script without that option
runs its default), the text suite and the mixed
workload first, within a total time budget (default 600 s quick, none full): a script that
would start after the budget is spent is skipped and reported, one that overruns the time left
is stopped. A script that fails does not stop the others. Afterwards: a PNG per result
(``benchmarks/plots.py``), the table (``benchmarks/report.py``, written into ``--readme``
between its markers when given) and a one-line status per script. Exits 1 if any script
failed or was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIRST = ("bench_text_suite", "bench_mixed")  # the suite's headline figures run first
# superseded by bench_text_suite (same workload, more methods); run it with --only bench_text
SKIP_BY_DEFAULT = ("bench_text",)


def discover(only: list[str] | None = None) -> list[Path]:
    """The bench scripts to run, headline ones first, then by name."""
    scripts = sorted(HERE.glob("bench_*.py"))
    if only:
        names = {s.stem for s in scripts}
        missing = [o for o in only if o not in names]
        if missing:
            raise ValueError(f"no benchmark scripts {missing}; have {sorted(names)}")
        scripts = [s for s in scripts if s.stem in only]
    else:
        scripts = [s for s in scripts if s.stem not in SKIP_BY_DEFAULT]
    return sorted(
        scripts,
        key=lambda s: (s.stem not in FIRST, FIRST.index(s.stem) if s.stem in FIRST else 0, s.stem),
    )


def run_script(
    script: Path, flag: str, limit: float | None, env: dict[str, str]
) -> tuple[str, float]:
    """Run one script; return its status ('ok', 'failed (rc N)', 'timed out') and seconds."""
    t0 = time.perf_counter()
    if f'"{flag}"' not in script.read_text():  # the script has no such option: its default run
        flag = ""
    cmd = [sys.executable, str(script), *([flag] if flag else [])]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=limit, text=True, capture_output=True)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or "")[-400:] if isinstance(e.stdout, str) else ""
        print(tail, flush=True)
        return "timed out", time.perf_counter() - t0
    print(proc.stdout[-3000:], end="", flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr, flush=True)
        return f"failed (rc {proc.returncode})", time.perf_counter() - t0
    return "ok", time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the longer sweeps (no budget)")
    parser.add_argument("--budget", type=float, help="total seconds (default 600 quick)")
    parser.add_argument("--readme", type=Path, help="write the table into this README")
    parser.add_argument("--only", help="comma-separated script names, e.g. bench_text_suite")
    parser.add_argument("--no-run", action="store_true", help="only the plots and the table")
    args = parser.parse_args(argv)
    budget = args.budget if args.budget is not None else (None if args.full else 600.0)
    flag = "--full" if args.full else "--quick"
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        scripts = [] if args.no_run else discover(args.only.split(",") if args.only else None)
    except ValueError as e:
        print(f"run_all: error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    statuses: dict[str, tuple[str, float]] = {}
    for script in scripts:
        left = None if budget is None else budget - (time.perf_counter() - start)
        if left is not None and left < 10:
            statuses[script.stem] = ("skipped (budget spent)", 0.0)
            continue
        print(
            f"== {script.stem} {flag}" + ("" if left is None else f" ({left:.0f} s left)"),
            flush=True,
        )
        statuses[script.stem] = run_script(script, flag, left, env)

    sys.path.insert(0, str(ROOT))
    from benchmarks import plots, report

    for path in sorted((HERE / "results").glob("*.json")):
        try:
            plots.plot_result(path)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            print(f"no plot for {path.name}: {e}", file=sys.stderr)
    report_args = ["--readme", str(args.readme)] if args.readme else []
    report.main(report_args)

    print(f"\nbenchmarks ({flag}), {time.perf_counter() - start:.0f} s in all:")
    for name, (status, seconds) in statuses.items():
        print(f"  {name:<24}{status:<24}{seconds:7.1f} s")
    return 0 if all(s == "ok" for s, _ in statuses.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
