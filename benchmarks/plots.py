"""One PNG per benchmark result: ``python benchmarks/plots.py [results/X.json ...]`` (default:
every ``benchmarks/results/*.json``) writes ``benchmarks/results/X.png`` next to each.

Owns only drawing (matplotlib, Agg backend: no display needed). Knows the shapes of the
results written by the scripts here (``text``, ``text_suite``, ``mixed``, ``http``, ``shm``,
``dispatch``, the load generator's); any other JSON gets a bar chart of its throughput-like
numbers (keys ending in ``per_s``, ``tokens_per_s``, ``speedup`` or ``ratio``), so adapter
benchmarks added later are plotted without changes here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"
Bars = list[tuple[str, float]]


def _numbers(data: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _numbers(v, f"{prefix}{k}.")
    elif isinstance(data, int | float) and not isinstance(data, bool):
        yield prefix.rstrip("."), float(data)


def _generic(data: dict[str, Any]) -> tuple[str, str, Bars]:
    ends = ("per_s", "tokens_per_s", "speedup", "ratio")
    bars = [(k, v) for k, v in _numbers(data) if k.split(".")[-1].endswith(ends)]
    return "throughput-like figures", "value", bars[:24]


def _rank(data: dict[str, Any]) -> tuple[str, str, Bars]:
    bars = [
        (f"{case} {scenario}", s["rank_over_eager"])
        for case, r in data["results"].items()
        for scenario, s in r.items()
        if isinstance(s, dict)
    ]
    return "a rank's time over the eager batched loop (lower is better)", "x eager", bars


def _text(data: dict[str, Any]) -> tuple[str, str, Bars]:
    bars = [(k, r["tokens_per_s"]) for k, r in data["results"].items() if "tokens_per_s" in r]
    return "useful output tokens/s (higher is better)", "tokens/s", bars


def _mixed(data: dict[str, Any]) -> tuple[str, str, Bars]:
    bars = []
    for kind, share in data.get("goodput_share", {}).get("mixed", {}).items():
        bars.append((f"{kind} mixed", share if share is not None else 0.0))
        alone = data["goodput_share"].get("alone", {}).get(kind)
        bars.append((f"{kind} alone", alone if alone is not None else 0.0))
    return "goodput share under the targets: mixed vs one class at a time", "share", bars


def _http(data: dict[str, Any]) -> tuple[str, str, Bars]:
    keys = ("python_api", "http_floor_get_models", "http_walks", "http_completions")
    return (
        "p50 latency (lower is better)",
        "ms",
        [(k, data[k]["p50_ms"]) for k in keys if k in data],
    )


def _shm(data: dict[str, Any]) -> tuple[str, str, Bars]:
    bars = []
    for row in data["rows"]:
        for way in ("view", "into", "copy"):
            bars.append((f"{row['size']} {way}", row[f"{way}_ratio"]))
    return "fraction of memcpy bandwidth", "fraction", bars


def _dispatch(data: dict[str, Any]) -> tuple[str, str, Bars]:
    bars = []
    for group in ("in_process", "cross_process", "zmq_floor"):
        for k, v in data.get(group, {}).items():
            bars.append((k, v["p50_us"]))
    return "p50 per dispatch (lower is better)", "us", bars


def _loadgen(data: dict[str, Any]) -> tuple[str, str, Bars]:
    bars = []
    for kind, b in data["summary"]["by_kind"].items():
        for key in ("first_s", "e2e_s"):
            for q in ("p50", "p99"):
                if b[key][q] is not None:
                    bars.append((f"{kind} {key[:-2]} {q}", 1000 * b[key][q]))
    return "latency percentiles per request kind", "ms", bars


KNOWN = {
    "text": _text,
    "text_suite": _text,
    "mixed": _mixed,
    "http": _http,
    "loadgen": _loadgen,
    "rank": _rank,
}


def bars_for(data: dict[str, Any]) -> tuple[str, str, Bars]:
    """(title, unit, bars) for a result, by its ``benchmark`` field or its shape."""
    name = str(data.get("benchmark", ""))
    if name in KNOWN:
        return KNOWN[name](data)
    if name.startswith("shm") and "rows" in data:
        return _shm(data)
    if name.startswith("per-node dispatch"):
        return _dispatch(data)
    return _generic(data)


def plot_result(path: Path, out: Path | None = None) -> Path:
    """Draw the result at ``path`` into ``out`` (default: the same name with ``.png``)."""
    data = json.loads(path.read_text())
    title, unit, bars = bars_for(data)
    out = out or path.with_suffix(".png")
    fig, ax = plt.subplots(figsize=(8, 0.35 * max(len(bars), 3) + 1.4))
    if bars:
        labels, values = zip(*bars)
        ax.barh(range(len(bars)), values, color="#4c72b0")
        ax.set_yticks(range(len(bars)), labels, fontsize=8)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    else:
        ax.text(0.5, 0.5, "no numeric results", ha="center", va="center")
    roof = data.get("roofline", {}).get("tokens_per_s") if isinstance(data, dict) else None
    if roof and data.get("benchmark") == "text_suite":
        ax.axvline(roof, color="#c44e52", linestyle="--", label=f"roofline {roof:.0f} tokens/s")
        ax.legend(fontsize=8, loc="lower right")
    machine = f"{data.get('cpu_count', '?')} CPUs, torch {data.get('torch', '?')}"
    if "device" in data:
        machine = f"{data['device']}, torch {data.get('torch', '?')}"
    commit = str(data.get("git_commit") or "")[:10]
    ax.set_title(f"{path.stem}: {title}\n{machine} {commit}", fontsize=9)
    ax.set_xlabel(unit)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    for path in paths or sorted(RESULTS.glob("*.json")):
        print(f"wrote {plot_result(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
