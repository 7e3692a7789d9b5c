"""``benchmarks/report.py`` (the README table from results/*.json), ``benchmarks/plots.py``
and ``benchmarks/run_all.py``'s discovery, on fabricated result files in a temporary
directory and a temporary README."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed

from benchmarks import plots, report, run_all

TEXT_SUITE = {
    "benchmark": "text_suite",
    "quick": True,
    "requests": 8,
    "length_range": [16, 64],
    "results": {
        "http": {"tokens_per_s": 41.94, "matches_sequential_generate": "8/8"},
        "bare": {"tokens_per_s": 80.0},
        "hf_cb": {"error": "boom"},
    },
    "walkserve_http_vs": {"bare": 41.94 / 80.0},
    "fraction_of_roofline": {"http": 0.0123, "bare": 0.0235},
    "machine": {"read_bytes_per_s": 3.4e10, "matmul_flops_per_s": 1.86e11},
    "roofline": {"tokens_per_s": 3400.0},
    "cpu_count": 2,
    "torch": "2.13.0+cpu",
    "git_commit": "0123456789abcdef",
}
MIXED = {
    "benchmark": "mixed",
    "quick": True,
    "slo": {"ttft": 1.0, "image": 5.0},
    "goodput_share": {"mixed": {"text": 0.5, "image": 1.0}, "alone": {"text": 0.75, "image": 1.0}},
    "cpu_count": 2,
    "torch": "2.13.0+cpu",
}
OWN_ROWS = {
    "benchmark": "speech_tts",
    "readme_rows": [{"benchmark": "tts | tiny", "machine": "1 GPU", "result": "rtf 0.31"}],
}
UNKNOWN = {"benchmark": "world", "steps_per_s": 12.5, "cpu_count": 2, "flag": True}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    d = tmp_path / "results"
    d.mkdir()
    for name, data in [
        ("text_suite", TEXT_SUITE),
        ("mixed", MIXED),
        ("speech", OWN_ROWS),
        ("world", UNKNOWN),
    ]:
        (d / f"{name}.json").write_text(json.dumps(data))
    return d


def test_table_rows_come_from_the_results(results: Path) -> None:
    table = report.table(results)
    lines = table.splitlines()
    assert lines[0] == "| benchmark | machine | result |"
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4  # one per file, sorted by file name: mixed, speech, text_suite, world
    assert "text 0.5 mixed vs 0.75 alone" in rows[0] and "image 1 mixed vs 1 alone" in rows[0]
    assert "ttft=1.0, image=5.0" in rows[0] and "2 CPUs, torch 2.13.0+cpu" in rows[0]
    assert rows[1] == "| tts / tiny | 1 GPU | rtf 0.31 |"  # as written, pipes escaped
    suite = rows[2]
    assert "http 42 tok/s (8/8 = generate)" in suite and "bare 80 tok/s" in suite
    assert "hf_cb failed" in suite and "@0123456" in suite
    assert "walkserve HTTP vs: bare 0.524" in suite
    assert "fraction of roofline: http 0.0123, bare 0.0235" in suite
    assert "roofline 3400 tok/s (read 34.0 GB/s, fp32 matmul 186 GFLOP/s)" in suite
    assert "[16, 64]" in suite and "--quick" in suite
    assert "steps_per_s 12.5" in rows[3] and "flag" not in rows[3] and "cpu_count" not in rows[3]


def test_readme_table_is_replaced_between_the_markers(results: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    before = "# Project\n\n## Benchmarks\n\nintro\n\n"
    after = "\n\n## Layout\n\nunchanged\n"
    readme.write_text(f"{before}{report.BEGIN}\n| old | table |\n{report.END}{after}")
    args = ["--readme", str(readme), "--results", str(results)]
    assert report.main([*args, "--check"]) == 1  # out of date
    assert report.main(args) == 0
    text = readme.read_text()
    assert text.startswith(before + report.BEGIN + "\n| benchmark |")
    assert text.endswith(report.END + after)
    assert "| old | table |" not in text and report.table(results) in text
    assert report.main([*args, "--check"]) == 0  # now up to date
    assert report.main(args) == 0 and readme.read_text() == text  # idempotent


def test_readme_without_markers_is_an_error(results: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="bench:begin"):
        report.replace_table(readme.read_text(), "x")
    assert report.main(["--readme", str(readme), "--results", str(results)]) == 2
    assert readme.read_text() == "# no markers\n"


def test_current_results_all_give_rows() -> None:
    table = report.table()
    for path in sorted(report.RESULTS.glob("*.json")):
        assert f"benchmarks/results/{path.name}" in table or "readme_rows" in path.read_text()


def test_plots_write_a_png_per_result(results: Path) -> None:
    for path in sorted(results.glob("*.json")):
        out = plots.plot_result(path)
        assert out == path.with_suffix(".png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, unit, bars = plots.bars_for(TEXT_SUITE)
    assert unit == "tokens/s" and bars == [("http", 41.94), ("bare", 80.0)]
    assert plots.bars_for(UNKNOWN)[2] == [("steps_per_s", 12.5)]


def test_run_all_discovers_the_bench_scripts() -> None:
    names = [p.stem for p in run_all.discover()]
    assert names[:2] == ["bench_text_suite", "bench_mixed"]
    assert "bench_http" in names and "bench_text" not in names  # superseded by the suite
    assert [p.stem for p in run_all.discover(["bench_text"])] == ["bench_text"]
    with pytest.raises(ValueError, match="no benchmark scripts"):
        run_all.discover(["bench_nope"])


def _row(data: dict, name: str) -> str:
    rows = report.rows_for(data, f"benchmarks/results/{name}.json")
    assert len(rows) == 1
    return " | ".join(rows[0])


def _generic_row(data: dict, name: str) -> str:
    return " | ".join(report._generic(data, f"benchmarks/results/{name}.json")[0])


def test_world_vjepa2_row() -> None:
    def horizon(cached_ms: float, native_ms: float, err: float) -> dict:
        return {
            "cached_ms_p50": cached_ms,
            "native_ms_p50": native_ms,
            "speedup": native_ms / cached_ms,
            "max_rel_error_cached_vs_native": err,
        }

    data = {
        "benchmark": "world_vjepa2",
        "quick": True,
        "model": "walkserve.adapters.vjepa2_ac:medium",
        "batch": 1,
        "served": {
            "4": horizon(100.0, 150.0, 1e-6),
            "15": horizon(300.0, 1200.0, 2e-6),
            "30": horizon(600.0, 4800.0, 3.1e-6),
        },
        "eager": {"4": horizon(50.0, 100.0, 1e-7), "30": horizon(500.0, 3000.0, 1e-7)},
        "target_h30": 10.0,
        "cpu_count": 2,
        "torch": "2.13.0+cpu",
    }
    row = _row(data, "world_vjepa2")
    assert "`benchmarks/bench_world.py`, `benchmarks/results/world_vjepa2.json` --quick" in row
    assert "vjepa2_ac:medium" in row
    assert "served p50 speedup 1.5x / 4x / 8x at horizons 4 / 15 / 30" in row
    assert "cached 600 ms vs native 4.8 s" in row
    assert "eager speedup 2x / 6x at horizons 4 / 30" in row
    assert "max relative error cached vs native 3.1e-06" in row
    del data["served"]
    assert _row(data, "world_vjepa2") == _generic_row(data, "world_vjepa2")


def test_image_janus_row() -> None:
    data = {
        "benchmark": "image_janus",
        "model": "walkserve.adapters.janus:small",
        "concurrency": 4,
        "results": {
            "upstream": {"latency_p50_s": 5.24, "latency_p95_s": 6.72, "images_per_s": 0.2},
            "served": {"latency_p50_s": 2.62, "latency_p95_s": 5.45, "images_per_s": 0.5},
        },
        "served_tokens_equal_upstream": "12/12",
        "cpu_count": 2,
    }
    row = _row(data, "image_janus")
    assert "`benchmarks/bench_janus.py`, `benchmarks/results/image_janus.json`)" in row
    assert "janus:small" in row and "--quick" not in row
    assert "served 2.62 s / 5.45 s vs upstream 5.24 s / 6.72 s" in row
    assert "(p50 served/upstream 0.5x)" in row  # computed when the result has no ratio
    assert "images/s at concurrency 4: served 0.5 vs upstream 0.2 (served/upstream 2.5x)" in row
    assert "upstream 12/12" in row
    del data["results"]["served"]
    assert _row(data, "image_janus") == _generic_row(data, "image_janus")


def test_image_diffusers_row() -> None:
    data = {
        "benchmark": "image_diffusers",
        "model": "walkserve.adapters.diffusers_dit:bench",
        "steps": 8,
        "results": {
            "pipeline": {
                "latency_p50_s": 1.84,
                "per_step_s": 0.2,
                "images_per_s_concurrency4": 0.4,
            },
            "served1": {
                "latency_p50_s": 1.52,
                "per_step_s": 0.18,
                "images_per_s_concurrency4": 0.8,
                "max_error_vs_pipeline": 8e-7,
            },
            "served2": {
                "latency_p50_s": 1.82,
                "per_step_s": 0.216,
                "images_per_s_concurrency4": 0.6,
                "max_error_vs_pipeline": 9e-7,
            },
        },
        "served1_vs_pipeline_images_per_s": 2.0,
        "cpu_count": 2,
    }
    row = _row(data, "image_diffusers")
    assert "`benchmarks/bench_image.py`, `benchmarks/results/image_diffusers.json`" in row
    assert "8 steps" in row
    assert (
        "pipeline 0.4, served 1 rank 0.8 (2x pipeline), served 2 ranks 0.6 (1.5x pipeline)" in row
    )
    assert "latency p50: pipeline 1.84 s, served 1 rank 1.52 s, served 2 ranks 1.82 s" in row
    assert "2 ranks / 1 rank 1.2x" in row
    assert "max error vs pipeline 9e-07" in row
    del data["results"]["served2"]  # one rank only: still a row, without the 2-rank figures
    row = _row(data, "image_diffusers")
    assert "served 1 rank 0.8 (2x pipeline)" in row and "2 ranks" not in row.split(" | ")[2]
    del data["results"]["pipeline"]
    assert _row(data, "image_diffusers") == _generic_row(data, "image_diffusers")


def test_speech_orpheus_row() -> None:
    def level(ttfa: float, apw: float, viability: float | None = None) -> dict:
        r = {"ttfa_mean_s": ttfa, "audio_s_per_wall_s": apw}
        if viability is not None:
            r["streaming_viability"] = viability
        return r

    data = {
        "benchmark": "speech_orpheus",
        "quick": True,
        "model": "walkserve.adapters.orpheus:bench",
        "tokens_per_request": 42,
        "ranks": 2,
        "results": {
            "native_c1": level(1.3, 0.4),
            "native_c4": level(1.8, 0.8),
            "served_c1": level(0.65, 0.2, 1.0),
            "served_c4": level(3.6, 0.16, 0.5),
            "served_c8": level(7.8, 0.18, 0.0),  # no native run at 8: shown as '-'
        },
        "ratios": {"c1": {"ttfa_native_over_served": 2.0}},
        "served_tokens_equal_generate": "13/13",
        "cpu_count": 2,
    }
    row = _row(data, "speech_orpheus")
    assert "`benchmarks/bench_speech.py`, `benchmarks/results/speech_orpheus.json` --quick" in row
    assert "2 ranks" in row and "42 tokens per request" in row
    assert "at concurrency 1 / 4 / 8" in row
    assert "time to first audio 650 ms / 3.6 s / 7.8 s served vs 1.3 s / 1.8 s / - native" in row
    assert "(native/served 2x / 0.5x / -)" in row
    assert "audio s per wall s 0.2 / 0.16 / 0.18 served vs 0.4 / 0.8 / - native" in row
    assert "(served/native 0.5x / 0.2x / -)" in row
    assert "streaming viability 100% / 50% / 0%" in row and "13/13" in row
    assert "greedy" not in row and "placement" not in row
    data["placement"] = "replicas"
    data["greedy_up_to_float32"] = {"rtol": 4e-06, "served": "12/13", "generate": "13/13"}
    row = _row(data, "speech_orpheus")
    assert "(2 ranks, placement replicas)" in row
    assert "(greedy up to float32 rounding, rtol 4e-06: served 12/13, generate() 13/13)" in row
    data["results"] = {}
    assert _row(data, "speech_orpheus") == _generic_row(data, "speech_orpheus")


def test_the_machine_is_the_gpu_named_or_the_cpu_count() -> None:
    """A script that names its device "cpu" (``bench_speech``) ran on the CPUs it counts; a
    GPU's name stands for itself."""
    base = {"cpu_count": 2, "torch": "2.13.0+cpu", "git_commit": "0123456789ab"}
    assert report.machine(base) == "2 CPUs, torch 2.13.0+cpu, @0123456"
    assert report.machine(base | {"device": "cpu"}) == "2 CPUs, torch 2.13.0+cpu, @0123456"
    h200 = base | {"device": "NVIDIA H200", "torch": "2.11.0"}
    assert report.machine(h200) == "NVIDIA H200, torch 2.11.0, @0123456"


def test_speech_omni_row() -> None:
    data = {
        "benchmark": "speech_omni",
        "model": "walkserve.adapters.qwen3_omni:tiny",
        "walkserve": {
            "1": {"ttfa_s": 0.35, "audio_s_per_wall_s": 2.5, "viability": 1.0},
            "4": {"ttfa_s": 2.6, "audio_s_per_wall_s": 3.3, "viability": 0.944},
        },
        "generate_per_request": {
            "1": {"ttfa_s": 0.7, "audio_s_per_wall_s": 3.75},
            "4": {"ttfa_s": 2.08, "audio_s_per_wall_s": 3.3},
        },
        "ttfa_ratio_generate_over_walkserve": {"1": 2.0, "4": 0.8},
        "throughput_ratio_walkserve_over_generate": {"1": 0.667, "4": 1.0},
        "cpu_count": 2,
    }
    row = _row(data, "speech_omni")
    assert "`benchmarks/bench_speech_omni.py`, `benchmarks/results/speech_omni.json`)" in row
    assert "qwen3_omni:tiny" in row
    assert "at concurrency 1 / 4:" in row  # a --quick-sized run has no level 8
    assert "time to first audio 350 ms / 2.6 s served vs 700 ms / 2.08 s generate" in row
    assert "(generate/served 2x / 0.8x)" in row
    assert "audio s per wall s 2.5 / 3.3 served vs 3.75 / 3.3 generate" in row
    assert "(served/generate 0.667x / 1x)" in row
    assert "streaming viability 100% / 94%" in row
    del data["walkserve"]
    assert _row(data, "speech_omni") == _generic_row(data, "speech_omni")


def test_net_row() -> None:
    data = {
        "benchmark": "net",
        "quick": True,
        "sizes_bytes": [1024, 1048576, 67108864],
        "paths": {
            "shm": {
                "seconds": {"1024": 7.04e-5, "1048576": 3.58e-4, "67108864": 0.161},
                "alpha_us": 68.4,
                "beta_gb_per_s": 3.14,
            },
            "tcp-inline": {
                "seconds": {"1024": 1.27e-4, "1048576": 0.0115, "67108864": 1.7},
                "alpha_us": 113.0,
                "beta_gb_per_s": 0.0764,
            },
            "mooncake": {"skipped": "not installed"},
        },
        "cpu_count": 2,
    }
    row = _row(data, "net")
    assert "`benchmarks/bench_net.py`, `benchmarks/results/net.json` --quick" in row
    assert "1 KiB / 1 MiB / 64 MiB" in row
    assert "shm 70.4 us / 358 us / 161 ms, alpha 68.4 us, beta 3.14 GB/s" in row
    assert "tcp-inline 127 us / 11.5 ms / 1.7 s, alpha 113 us, beta 0.0764 GB/s" in row
    assert "mooncake skipped (not installed)" in row
    del data["paths"]
    assert _row(data, "net") == _generic_row(data, "net")
