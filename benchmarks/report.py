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
                   CUDA graphs, world_vjepa2, image_janus, image_diffusers, speech_orpheus,
                   speech_omni, net): the formatter below
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
    device = data.get("device")  # a GPU's name; "cpu" where a script names the CPU as its device
    where = device if device and device != "cpu" else f"{data.get('cpu_count', '?')} CPUs"
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
            notes = []
            if r.get("matches_sequential_generate"):
                notes.append(f"{r['matches_sequential_generate']} = generate")
            if "worker_threads" in r:
                notes.append(f"worker threads {r['worker_threads']}")
            suffix = f" ({', '.join(notes)})" if notes else ""
            parts.append(f"{name} {r['tokens_per_s']:.0f} tok/s{suffix}")
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
            f" {x['pool_contiguous']['p50_us']:.0f} us"
            + (
                f" (over ZeroMQ instead of the rank link: {x['pool_contiguous_zmq']['p50_us']:.0f} us)"
                if "pool_contiguous_zmq" in x
                else ""
            ),
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


def _quick(data: dict[str, Any]) -> str:
    return " --quick" if data.get("quick") else ""


def _script(data: dict[str, Any], src: str, script: str) -> str:
    """'`benchmarks/<script>`, `<src>`' (and ' --quick' for a quick run): the cell's source."""
    return f"`benchmarks/{script}`, `{src}`{_quick(data)}"


def _model(data: dict[str, Any]) -> str:
    """The model's config, 'walkserve.adapters.janus:small' -> 'janus:small' ('?' when unsaid)."""
    return str(data.get("model") or "?").rsplit(".", 1)[-1]


def _secs(seconds: Any) -> str:
    """A duration to 3 significant digits in us, ms or s; '-' when missing."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def _x(value: Any, digits: int = 3) -> str:
    """A ratio: '1.48x' ('-' when missing)."""
    return "-" if value is None else f"{float(value):.{digits}g}x"


def _ratio(stored: Any, num: Any, den: Any) -> float | None:
    """``stored`` when the result has it, else ``num / den`` when both are there."""
    if stored is not None:
        return float(stored)
    if num is None or not den:
        return None
    return float(num) / float(den)


def _by_level(d: dict[str, Any]) -> list[tuple[int, Any]]:
    return sorted((int(k), v) for k, v in d.items())


def _world(data: dict[str, Any], src: str) -> list[Row]:
    served = _by_level(data["served"])
    eager = _by_level(data.get("eager") or {})
    if not served:
        raise ValueError("no served horizons")
    h = [str(k) for k, _ in served]
    parts = [
        f"served p50 speedup {' / '.join(_x(r['speedup']) for _, r in served)}"
        f" at horizons {' / '.join(h)}"
    ]
    last_h, last = served[-1]
    parts.append(
        f"at horizon {last_h}: cached {_secs(last['cached_ms_p50'] / 1e3)} vs native"
        f" {_secs(last['native_ms_p50'] / 1e3)}"
        + (f" (target {_x(data['target_h30'])})" if last_h == 30 and "target_h30" in data else "")
    )
    if eager:
        parts.append(
            f"eager speedup {' / '.join(_x(r['speedup']) for _, r in eager)}"
            f" at horizons {' / '.join(str(k) for k, _ in eager)}"
        )
    errors = [
        r["max_rel_error_cached_vs_native"]
        for _, r in served + eager
        if r.get("max_rel_error_cached_vs_native") is not None
    ]
    if errors:
        parts.append(f"max relative error cached vs native {max(errors):.2g}")
    what = (
        f"V-JEPA 2-AC rollout latency, KV-cached vs native recompute, `{_model(data)}`,"
        f" batch {data.get('batch', '?')} ({_script(data, src, 'bench_world.py')})"
    )
    return [(what, machine(data), "; ".join(parts))]


def _janus(data: dict[str, Any], src: str) -> list[Row]:
    up, sv = data["results"]["upstream"], data["results"]["served"]
    lat = _ratio(
        data.get("latency_p50_served_vs_upstream"), sv["latency_p50_s"], up["latency_p50_s"]
    )
    ips = _ratio(
        data.get("images_per_s_served_vs_upstream"), sv["images_per_s"], up["images_per_s"]
    )
    conc = data.get("concurrency", "?")
    parts = [
        f"latency p50 / p95 at concurrency 1: served {_secs(sv['latency_p50_s'])} /"
        f" {_secs(sv.get('latency_p95_s'))} vs upstream {_secs(up['latency_p50_s'])} /"
        f" {_secs(up.get('latency_p95_s'))} (p50 served/upstream {_x(lat)})",
        f"images/s at concurrency {conc}: served {_f(sv['images_per_s'])} vs upstream"
        f" {_f(up['images_per_s'])} (served/upstream {_x(ips)})",
    ]
    if data.get("served_tokens_equal_upstream"):
        parts.append(f"served image tokens = upstream {data['served_tokens_equal_upstream']}")
    what = (
        f"Janus image generation, served vs upstream `generate()`, `{_model(data)}`"
        f" ({_script(data, src, 'bench_janus.py')})"
    )
    return [(what, machine(data), "; ".join(parts))]


def _diffusers(data: dict[str, Any], src: str) -> list[Row]:
    res = data["results"]
    pipe = res["pipeline"]
    served = [
        (k, label, res[k])
        for k, label in (("served1", "1 rank"), ("served2", "2 ranks"))
        if k in res
    ]
    if not served:
        raise KeyError("served1")
    key = "images_per_s_concurrency4"
    ips = ", ".join(
        f"served {label} {_f(r[key])}"
        f" ({_x(_ratio(data.get(f'{k}_vs_pipeline_images_per_s'), r[key], pipe[key]))} pipeline)"
        for k, label, r in served
    )
    parts = [f"images/s at concurrency 4: pipeline {_f(pipe[key])}, {ips}"]
    lat = ", ".join(f"served {label} {_secs(r.get('latency_p50_s'))}" for _, label, r in served)
    parts.append(f"latency p50: pipeline {_secs(pipe.get('latency_p50_s'))}, {lat}")
    if "served1" in res and "served2" in res:
        per_step = _ratio(
            data.get("two_ranks_vs_one_rank_per_step"),
            res["served2"].get("per_step_s"),
            res["served1"].get("per_step_s"),
        )
        parts.append(f"time per step, 2 ranks / 1 rank {_x(per_step)}")
    errors = [r["max_error_vs_pipeline"] for _, _, r in served if "max_error_vs_pipeline" in r]
    if errors:
        parts.append(f"max error vs pipeline {max(errors):.2g}")
    what = (
        f"diffusers SD3 image generation, served (1 rank, 2 ranks) vs StableDiffusion3Pipeline,"
        f" `{_model(data)}`, {data.get('steps', '?')} steps"
        f" ({_script(data, src, 'bench_image.py')})"
    )
    return [(what, machine(data), "; ".join(parts))]


def _speech_cells(levels: list[dict[str, Any]], baseline: str) -> str:
    """One cell from per-level dicts (c, ttfa, base_ttfa, ttfa_ratio, apw, base_apw,
    apw_ratio, viability): TTFA, audio s per wall s and viability, levels slash-separated."""
    if not levels:
        raise ValueError("no concurrency levels")

    def row(key: str, fmt: Callable[[Any], str]) -> str:
        return " / ".join(fmt(lv.get(key)) for lv in levels)

    def pct(v: Any) -> str:
        return "-" if v is None else f"{float(v):.0%}"

    cs = " / ".join(str(lv["c"]) for lv in levels)
    return "; ".join(
        [
            f"at concurrency {cs}: time to first audio {row('ttfa', _secs)} served vs"
            f" {row('base_ttfa', _secs)} {baseline} ({baseline}/served"
            f" {row('ttfa_ratio', _x)})",
            f"audio s per wall s {row('apw', _f)} served vs {row('base_apw', _f)} {baseline}"
            f" (served/{baseline} {row('apw_ratio', _x)})",
            f"streaming viability {row('viability', pct)}",
        ]
    )


def _speech_orpheus(data: dict[str, Any], src: str) -> list[Row]:
    res, ratios = data["results"], data.get("ratios") or {}
    cs = sorted({int(k.rsplit("_c", 1)[1]) for k in res if k.startswith(("served_c", "native_c"))})
    levels = []
    for c in cs:
        s, n, r = (
            res.get(f"served_c{c}") or {},
            res.get(f"native_c{c}") or {},
            ratios.get(f"c{c}") or {},
        )
        levels.append(
            {
                "c": c,
                "ttfa": s.get("ttfa_mean_s"),
                "base_ttfa": n.get("ttfa_mean_s"),
                "ttfa_ratio": _ratio(
                    r.get("ttfa_native_over_served"), n.get("ttfa_mean_s"), s.get("ttfa_mean_s")
                ),
                "apw": s.get("audio_s_per_wall_s"),
                "base_apw": n.get("audio_s_per_wall_s"),
                "apw_ratio": _ratio(
                    r.get("audio_per_wall_served_over_native"),
                    s.get("audio_s_per_wall_s"),
                    n.get("audio_s_per_wall_s"),
                ),
                "viability": s.get("streaming_viability"),
            }
        )
    result = _speech_cells(levels, "native")
    if data.get("served_tokens_equal_generate"):
        result += f"; served tokens = generate() {data['served_tokens_equal_generate']}"
    greedy = data.get("greedy_up_to_float32")
    if isinstance(greedy, dict):
        result += (
            f" (greedy up to float32 rounding, rtol {greedy.get('rtol')}: served"
            f" {greedy.get('served')}, generate() {greedy.get('generate')})"
        )
    ranks = f"{data.get('ranks', '?')} ranks"
    if data.get("placement"):
        ranks += f", placement {data['placement']}"
    what = (
        f"Orpheus streamed speech, served ({ranks}) vs native"
        f" `generate()` + SNAC decode, `{_model(data)}`, {data.get('tokens_per_request', '?')}"
        f" tokens per request ({_script(data, src, 'bench_speech.py')})"
    )
    return [(what, machine(data), result)]


def _speech_omni(data: dict[str, Any], src: str) -> list[Row]:
    served, base = data["walkserve"], data.get("generate_per_request") or {}
    ttfa_r = data.get("ttfa_ratio_generate_over_walkserve") or {}
    apw_r = data.get("throughput_ratio_walkserve_over_generate") or {}
    levels = []
    for c in sorted({int(k) for k in (*served, *base)}):
        s, b = served.get(str(c)) or {}, base.get(str(c)) or {}
        levels.append(
            {
                "c": c,
                "ttfa": s.get("ttfa_s"),
                "base_ttfa": b.get("ttfa_s"),
                "ttfa_ratio": _ratio(ttfa_r.get(str(c)), b.get("ttfa_s"), s.get("ttfa_s")),
                "apw": s.get("audio_s_per_wall_s"),
                "base_apw": b.get("audio_s_per_wall_s"),
                "apw_ratio": _ratio(
                    apw_r.get(str(c)), s.get("audio_s_per_wall_s"), b.get("audio_s_per_wall_s")
                ),
                "viability": s.get("viability"),
            }
        )
    what = (
        f"Qwen3-Omni speech, served vs per-request `generate()`, `{_model(data)}`"
        f" ({_script(data, src, 'bench_speech_omni.py')})"
    )
    return [(what, machine(data), _speech_cells(levels, "generate"))]


def _size(nbytes: int) -> str:
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= n and nbytes % n == 0:
            return f"{nbytes // n} {unit}"
    return f"{nbytes} B"


def _net(data: dict[str, Any], src: str) -> list[Row]:
    sizes = [int(n) for n in data["sizes_bytes"]]
    parts = []
    for name, p in data["paths"].items():
        if "seconds" not in p:
            parts.append(f"{name} skipped" + (f" ({p['skipped']})" if p.get("skipped") else ""))
            continue
        times = " / ".join(_secs(p["seconds"].get(str(n))) for n in sizes)
        parts.append(
            f"{name} {times}, alpha {_f(p.get('alpha_us'))} us, beta"
            f" {_f(p.get('beta_gb_per_s'))} GB/s"
        )
    if not parts:
        raise ValueError("no paths")
    what = (
        f"tensor transfer time by path at {' / '.join(_size(n) for n in sizes)}, fitted"
        f" t = alpha + bytes/beta ({_script(data, src, 'bench_net.py')})"
    )
    return [(what, machine(data), "; ".join(parts))]


def _loops(data: dict[str, Any], src: str) -> list[Row]:
    cases = data["results"]
    parts = []
    for name, r in cases.items():
        parts.append(
            f"{name}: batch 1 served {_secs(r['served_p50_s'])} vs eager {_secs(r['eager_p50_s'])}"
            f" ({_x(r['served_over_eager'])}, target 1.2x"
            + (
                f"; each request's pair: median {_x(r['paired_served_over_eager'])}"
                if r.get("paired_served_over_eager")
                else ""
            )
            + (f"; CPU {_x(r['cpu_served_over_eager'])}" if r.get("cpu_served_over_eager") else "")
            + ")"
            + (
                f"; back to back {_secs(r['steady_served_p50_s'])} vs"
                f" {_secs(r['steady_eager_p50_s'])} ({_x(r['steady_served_over_eager'])})"
                if r.get("steady_served_p50_s")
                else ""
            )
            + f"; {r['concurrent']} concurrent"
            f" {_x(r['throughput_ratio'])} the eager one-by-one throughput (target 4x)"
            + (
                f" (rounds back to back each way: {_x(r['steady_throughput_ratio'])})"
                if r.get("steady_throughput_ratio")
                else ""
            )
            + (
                f", the same batch run eagerly {_x(r['batched_throughput_ratio'])}"
                if r.get("batched_throughput_ratio")
                else ""
            )
            + _overhead(r.get("overhead"))
        )
    if data.get("loadavg_before"):
        parts.append(f"1-min load {data['loadavg_before'][0]:.1f} before")
    what = (
        "served loops vs the same loops run eagerly in one process, one rank, torch threads"
        f" {data.get('torch_threads', '?')} ({_script(data, src, 'bench_loops.py')})"
    )
    return [(what, machine(data), "; ".join(parts))]


def _overhead(o: dict[str, Any] | None) -> str:
    """bench_loops' batch-1 model: fixed and per-step cost over eager, and the loop length
    from which served / eager is at most 1.2."""
    if not o:
        return ""
    reach = o.get("length_for_1_2x")
    return (
        f"; over eager: {_secs(o['fixed_overhead_s'])} per request +"
        f" {_secs(o['per_step_overhead_s'])} per step (eager's step"
        f" {_secs(o['eager_per_step_s'])}), so 1.2x "
        + ("at no loop length" if reach is None else f"from {reach:.0f} steps")
    )


def _soak(data: dict[str, Any], src: str) -> list[Row]:
    req, args, slope = data["requests"], data["args"], data["slope_per_hour"]
    parts = [
        f"{req['total']} requests in {_secs(args['duration'])}: {req['ok']} ok, {req['cancelled']}"
        f" cancelled, {req['failed_by_kill']} failed by the kills, {req['unanswered']} unanswered",
        f"rank restarts {' / '.join(_secs(t) for t in data['restart_s'])}",
        f"server RSS slope {slope['rss_mib:server']:+.1f} MiB/h",
        f"at the end {data['end']['live_values']} live values, {data['end']['kv_pages_in_use']}"
        f" KV pages, {data['end']['shm_in_use']} shared-memory slots",
    ]
    load = data.get("machine", {}).get("load_average")
    if load:
        parts.append(f"1-min load {load[0]:.1f} at the end")
    what = (
        f"soak: mixed traffic with random cancels, rank 0 SIGKILLed every"
        f" {_secs(args['kill_every'])} ({_script(data, src, 'bench_soak.py')})"
    )
    return [(what, machine(data.get("machine", data)), "; ".join(parts))]


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
    "world_vjepa2": _world,
    "image_janus": _janus,
    "image_diffusers": _diffusers,
    "speech_orpheus": _speech_orpheus,
    "speech_omni": _speech_omni,
    "net": _net,
    "loops": _loops,
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
        if "slope_per_hour" in data and "requests" in data:
            return _soak(data, src)
        if "us_per_call_batch8" in data:
            return _cuda_graphs(data, src)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
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
