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
