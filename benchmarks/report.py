"""The README's benchmarks table, generated from ``benchmarks/results/*.json``:
``python benchmarks/report.py [--readme README.md] [--check]``.

Rewrites what lies between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in the README
(the markers stay; nothing else changes) with one Markdown table: a row (or a few) per result
file, each saying what was measured, on what machine (core count, torch version, GPU; the
commit), and the headline figures. Without ``--readme`` it prints the table.

Which rows a result gives:

    "readme_rows": [{"benchmark": ..., "machine": ..., "result": ...}, ...]
                   in the JSON itself: used as written (any bench_*.py can say its own rows)
    a known ``benchmark`` name (text, text_suite, mixed, http, shm, dispatch, loadgen,
                   CUDA graphs): the formatter below
    anything else: its top-level numbers, named

``--check`` exits 1 when the README's table is not what the results give (for CI).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
Row = tuple[str, str, str]  # benchmark, machine, result


def machine(data: dict[str, Any]) -> str:
    """'2 CPUs, torch 2.13.0+cpu, @abc1234' (or the GPU's name when there is one)."""
    torch = data.get("torch") or data.get("torch_version") or "?"
    where = data.get("device") or f"{data.get('cpu_count', '?')} CPUs"
    commit = str(data.get("git_commit") or "")[:7]
    return f"{where}, torch {torch}" + (f", @{commit}" if commit else "")


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _text(data: dict[str, Any], src: str) -> list[Row]:
    results = data["results"]
    lo, hi = data["length_range"]
    parts = []
    for name, r in results.items():
        if "tokens_per_s" in r:
            same = r.get("matches_sequential_generate")
            parts.append(
                f"{name} {r['tokens_per_s']:.0f} tok/s" + (f" ({same} = generate)" if same else "")
            )
        elif "error" in r:
            parts.append(f"{name} failed")
    if data.get("benchmark") == "text" and "paged_matches_sequential_generate" in data:
        parts.append(f"paged == sequential generate {data['paged_matches_sequential_generate']}")
    extra = []
    for key, label in (
        ("walkserve_http_vs", "walkserve HTTP vs"),
        ("time_overhead_vs_bare", "time overhead vs bare loop"),
        ("time_overhead_vs_paged_forward", "time overhead vs its own forwards"),
        ("fraction_of_roofline", "fraction of roofline"),
    ):
        if data.get(key):
            extra.append(f"{label}: " + ", ".join(f"{k} {v:.3g}" for k, v in data[key].items()))
    roof = data.get("roofline", {})
    if "tokens_per_s" in roof:
        m = data["machine"]
        extra.append(
            f"roofline {roof['tokens_per_s']:.0f} tok/s (read {m['read_bytes_per_s'] / 1e9:.1f} GB/s,"
            f" fp32 matmul {m['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s)"
        )
    quick = " --quick" if data.get("quick") else ""
    what = (
        f"text generation, 35M Llama, {data['requests']} requests, lengths uniform in"
        f" [{lo}, {hi}] (`{src}`{quick})"
    )
    return [(what, machine(data), "; ".join(parts + extra))]


def _mixed(data: dict[str, Any], src: str) -> list[Row]:
    share = data.get("goodput_share", {})
    parts = []
    for kind, mixed in share.get("mixed", {}).items():
        alone = share.get("alone", {}).get(kind)
        parts.append(f"{kind} {_f(mixed, 2)} mixed vs {_f(alone, 2)} alone")
    targets = ", ".join(f"{k}={v}" for k, v in data.get("slo", {}).items())
    quick = " --quick" if data.get("quick") else ""
    what = f"mixed text + speech + image, open loop, goodput share under {targets} (`{src}`{quick})"
    return [(what, machine(data), "; ".join(parts))]


def _http(data: dict[str, Any], src: str) -> list[Row]:
    o = data["overhead_over_python_api"]
    load = data["load"]
    return [
        (
            f"HTTP overhead over `Server.run`, p50 (`{src}`)",
            machine(data),
            f"+{o['walks']['p50_ms']:.1f} ms via /v1/walks, +{o['completions']['p50_ms']:.1f} ms"
            f" via /v1/completions (Server.run {data['python_api']['p50_ms']:.1f} ms)",
        ),
        (
            f"{load['clients']} concurrent streams against --max-queued {load['max_queued']} (same)",
            machine(data),
            f"{load['ok_200']} x 200, {load['busy_503']} x 503, {len(load['other'])} other,"
            f" {load['wall_s']:.1f} s",
        ),
    ]


def _shm(data: dict[str, Any], src: str) -> list[Row]:
    cells = [
        f"{r['size']}: view {r['view_ratio']:.2f}, into {r['into_ratio']:.2f}, copy {r['copy_ratio']:.2f}"
        for r in data["rows"]
    ]
    return [
        (f"shared-memory transfer vs memcpy bandwidth (`{src}`)", machine(data), "; ".join(cells))
    ]


def _dispatch(data: dict[str, Any], src: str) -> list[Row]:
    i, x = data["in_process"], data["cross_process"]
    return [
        (
            f"node dispatch, trivial node, p50 (`{src}`)",
            machine(data),
            f"in-process {i['executor_glue']['p50_us']:.1f} us (glue) /"
            f" {i['executor_component']['p50_us']:.1f} us (component) vs"
            f" {i['bare_call']['p50_us']:.2f} us bare; cross-process"
            f" {x['pool_contiguous']['p50_us']:.0f} us",
        ),
        *(
            [
                (
                    "idle worker memory (same script)",
                    machine(data),
                    f"{data['memory']['worker_rss_idle_mb']:.0f} MB RSS with a model loaded"
                    f" (bare `import torch`: {data['memory']['python_import_torch_rss_mb']:.0f} MB)",
                )
            ]
            if "memory" in data
            else []
        ),
    ]


def _loadgen(data: dict[str, Any], src: str) -> list[Row]:
    o = data["summary"]["overall"]
    parts = [f"{o['succeeded']}/{o['requests']} ok", f"{o['requests_per_s']:.2f} req/s"]
    if o["first_s"]["p50"] is not None:
        parts.append(f"first p50 {1000 * o['first_s']['p50']:.0f} ms")
    if "goodput" in o:
        parts.append(f"goodput {o['goodput']['share']:.2f}")
    return [(f"load generator run, {data['mode']} loop (`{src}`)", machine(data), ", ".join(parts))]


def _cuda_graphs(data: dict[str, Any], src: str) -> list[Row]:
    speedups = [
        r["speedup"]
        for r in data.get("us_per_call_batch8", {}).values()
        if isinstance(r, dict) and "speedup" in r
    ]
    result = (
        f"{min(speedups):.1f}x to {max(speedups):.1f}x lower time per call" if speedups else "-"
    )
    return [
        (
            f"CUDA-graph replay vs eager, per component call at batch 8 (`{src}`)",
            machine(data),
            result,
        )
    ]


def _generic(data: dict[str, Any], src: str) -> list[Row]:
    numbers = [
        f"{k} {_f(v)}"
        for k, v in data.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "cpu_count"
    ]
    name = str(data.get("benchmark") or Path(src).stem)
    return [(f"{name} (`{src}`)", machine(data), ", ".join(numbers[:6]) or "see the JSON")]


FORMATTERS: dict[str, Callable[[dict[str, Any], str], list[Row]]] = {
    "text": _text,
    "text_suite": _text,
    "mixed": _mixed,
    "http": _http,
    "loadgen": _loadgen,
}


def rows_for(data: dict[str, Any], src: str) -> list[Row]:
    """The table rows of one result (``src``: its path as the README shows it)."""
    if isinstance(data.get("readme_rows"), list):
        return [(r["benchmark"], r["machine"], r["result"]) for r in data["readme_rows"]]
    name = str(data.get("benchmark", ""))
    try:
        if name in FORMATTERS:
            return FORMATTERS[name](data, src)
        if name.startswith("shm") and "rows" in data:
            return _shm(data, src)
        if name.startswith("per-node dispatch"):
            return _dispatch(data, src)
        if "us_per_call_batch8" in data:
            return _cuda_graphs(data, src)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        pass  # an older or partial result: fall back to its top-level numbers
    return _generic(data, src)


def table(results_dir: Path = RESULTS) -> str:
    """The Markdown table of every ``*.json`` in ``results_dir``, sorted by file name."""
    lines = ["| benchmark | machine | result |", "| --- | --- | --- |"]
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); rerun its benchmark") from None
        if not isinstance(data, dict):
            continue
        src = f"benchmarks/results/{path.name}"
        for row in rows_for(data, src):
            lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    lines.append("")
    lines.append(
        "Generated by `python benchmarks/report.py --readme README.md` from"
        " `benchmarks/results/*.json`; each figure comes from a run of the script named in its row."
    )
    return "\n".join(lines)


def replace_table(readme: str, new_table: str) -> str:
    """``readme`` with the text between the markers replaced by ``new_table``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(
            f"the README needs the markers {BEGIN} and {END} (in this order) around the"
            " benchmarks table; add them where the table goes"
        )
    return readme[: start + len(BEGIN)] + "\n" + new_table + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, help="rewrite the table in this file")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results directory")
    parser.add_argument(
        "--check", action="store_true", help="with --readme: exit 1 if the table is out of date"
    )
    args = parser.parse_args(argv)
    try:
        new_table = table(args.results)
        if args.readme is None:
            print(new_table)
            return 0
        old = args.readme.read_text()
        new = replace_table(old, new_table)
    except (ValueError, OSError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            print(f"{args.readme}: the benchmarks table is out of date; run {sys.argv[0]} --readme")
            return 1
        return 0
    args.readme.write_text(new)
    print(f"updated the benchmarks table in {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
