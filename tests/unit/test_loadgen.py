"""The pure parts of the load generator (``benchmarks/loadgen.py``): seeded workload sampling,
arrival times, SSE and WAV parsing, percentiles, streaming viability and goodput, checked on
fabricated records against numbers computed independently here (numpy, statistics, by hand)."""

from __future__ import annotations

import random
import statistics
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed

from benchmarks import loadgen
from benchmarks.loadgen import Lengths, Record, Workload

MIX = Workload.parse_mix("text=3,chat=1,speech=1,image=1,walk:prefill=1")
WALKS = (("prefill", '{"prompt_ids": [[5, 6]], "max_new_tokens": 2}'),)


def test_workload_is_seeded_and_reproducible() -> None:
    w = Workload(mix=MIX, walk_inputs=WALKS, prompt_len=Lengths(4, 9), seed=3, model="m")
    a, b = loadgen.plan(w, 50, warmup=2), loadgen.plan(w, 50, warmup=2)
    assert a == b
    other = loadgen.plan(Workload(mix=MIX, walk_inputs=WALKS, seed=4), 50)
    assert [p.body for p in a[2:]] != [p.body for p in other]
    assert [p.warmup for p in a] == [True, True] + [False] * 50
    kinds = {p.kind for p in a}
    assert kinds == {"text", "chat", "speech", "image", "walk"}
    for p in a:
        if p.kind == "text":
            ids = p.body["prompt"]
            assert len(ids) == p.prompt_len and 4 <= p.prompt_len <= 9
            assert all(3 <= t < 259 for t in ids) and 16 <= p.body["max_tokens"] <= 64
            assert p.body["return_token_ids"] and p.body["stream"] and p.body["model"] == "m"
        if p.kind == "speech":
            assert len(p.body["input"]) == p.prompt_len and p.body["response_format"] == "wav"
        if p.kind == "walk":
            assert p.route == "/v1/walks/prefill" and p.body["inputs"]["prompt_ids"] == [[5, 6]]


def test_mix_weights_are_respected() -> None:
    w = Workload(mix=Workload.parse_mix("text=3,image=1"))
    kinds = [p.kind for p in loadgen.plan(w, 4000)]
    assert 0.72 < kinds.count("text") / 4000 < 0.78


def test_lengths_uniform_and_parsing() -> None:
    rng = random.Random(0)
    draws = [Lengths.parse("16:256").sample(rng) for _ in range(5000)]
    assert min(draws) == 16 and max(draws) == 256
    assert abs(statistics.mean(draws) - 136) < 4
    assert Lengths.parse("uniform:2:3") == Lengths(2, 3) and Lengths.parse("7") == Lengths(7, 7)
    for bad in ("0", "5:4", "a:b", "1:2:3"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def test_bad_workloads_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="unknown request kind 'video'"):
        Workload(mix=(("video", 1.0),))
    with pytest.raises(ValueError, match="--walk-inputs"):
        Workload(mix=(("walk:decode", 1.0),))
    with pytest.raises(ValueError, match="KIND=WEIGHT"):
        Workload.parse_mix("text=lots")


def test_arrival_times_have_the_asked_rate_and_burstiness() -> None:
    times = loadgen.arrival_times(20000, rate=5.0, burstiness=1.0, seed=1)
    assert times[0] == 0 and times == sorted(times)
    gaps = np.diff(times)
    assert abs(gaps.mean() - 0.2) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV 1
    bursty = np.diff(loadgen.arrival_times(20000, rate=5.0, burstiness=0.25, seed=1))
    assert abs(bursty.mean() - 0.2) < 0.02
    assert abs(bursty.std() / bursty.mean() - 2.0) < 0.15  # gamma shape k: CV 1/sqrt(k)
    assert loadgen.arrival_times(5, 2.0, seed=9) == loadgen.arrival_times(5, 2.0, seed=9)
    with pytest.raises(ValueError, match="rate"):
        loadgen.arrival_times(3, 0.0)


def test_sse_parser_handles_any_split() -> None:
    stream = (
        b": keep-alive\n\n"
        b'data: {"a": 1}\n\n'
        b"event: ping\r\ndata: line one\r\ndata: line two\r\n\r\n"
        b"data:[DONE]\n\n"
    )
    want = ['{"a": 1}', "line one\nline two", "[DONE]"]
    for cut in range(len(stream) + 1):
        parser = loadgen.SSEParser()
        got = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        assert got == want, cut
    parser = loadgen.SSEParser()
    assert [e for b in stream for e in parser.feed(bytes([b]))] == want


def test_wav_header_parsing() -> None:
    from walkserve.api import media

    header = media.wav_header(24000, None)
    for cut in range(len(header)):
        assert loadgen.wav_format(header[:cut]) is None
    fmt = loadgen.wav_format(header + b"\x00" * 10)
    assert fmt == loadgen.WavFormat(24000, 1, 2, len(header))
    assert fmt.seconds(48000) == 1.0
    with pytest.raises(ValueError, match="not a WAV"):
        loadgen.wav_format(b"ID3" + b"\x00" * 60)
    stereo = bytearray(header)
    stereo[22:24] = struct.pack("<H", 2)
    assert loadgen.wav_format(bytes(stereo)).channels == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 95, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [float(v) for v in np.random.default_rng(0).exponential(size=102)]
    assert loadgen.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert loadgen.percentile([3.0], q) == 3.0
    assert loadgen.percentile([], q) is None


def text_record(i: int, token_times: list[float], ok: bool = True) -> Record:
    r = Record(i, "text", "/v1/completions", 4, len(token_times), ok=ok, status=200)
    r.token_times = token_times
    r.first, r.end = token_times[0], token_times[-1]
    r.output_tokens = len(token_times)
    return r


def speech_record(i: int, arrivals: list[float], seconds: list[float]) -> Record:
    r = Record(i, "speech", "/v1/audio/speech", 4, 16, ok=True, status=200)
    r.chunk_times, r.chunk_seconds = arrivals, seconds
    r.first, r.end, r.audio_seconds = arrivals[0], arrivals[-1], sum(seconds)
    return r


def test_record_figures() -> None:
    r = text_record(0, [0.2, 0.3, 0.5, 0.6])
    assert r.tpot == pytest.approx((0.6 - 0.2) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.1])
    # chunks of 1 s audio: the second arrives at 0.9 (playback of chunk 0 ends at 1.0: on time),
    # the third at 2.5 (chunks 0-1 end at 2.0: late), the fourth at 2.9 (0-2 end at 3.0: on time)
    s = speech_record(1, [0.0, 0.9, 2.5, 2.9], [1.0, 1.0, 1.0, 1.0])
    assert s.viability == pytest.approx(2 / 3)
    assert s.rtf == pytest.approx(2.9 / 4.0)
    assert speech_record(2, [0.3], [0.5]).viability == 1.0


def test_summary_and_goodput_on_fabricated_records() -> None:
    fast = [
        text_record(i, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05, 0.1 * (i + 1) + 0.1]) for i in range(5)
    ]
    slow = text_record(5, [2.0, 2.5, 3.0])
    failed = Record(6, "text", "/v1/completions", 4, 3, status=503, error="busy")
    late = speech_record(7, [0.1, 1.0], [0.5, 0.5])  # second chunk after 0.1 + 0.5: late
    good_speech = speech_record(8, [0.1, 0.4], [0.5, 0.5])
    image = Record(9, "image", "/v1/images/generations", 8, None, ok=True, status=200)
    image.first = image.end = 1.5
    records = [*fast, slow, failed, late, good_speech, image]
    slo = loadgen.parse_slo("ttft=1.0,tpot=0.2,image=1.0,viability=1")
    summary = loadgen.summarize(records, wall_s=4.0, slo=slo)
    text = summary["by_kind"]["text"]
    assert text["requests"] == 7 and text["succeeded"] == 6
    assert text["failures_by_status"] == {"503": 1}
    assert text["output_tokens"] == 18 and text["output_tokens_per_s"] == 18 / 4.0
    firsts = [0.1, 0.2, 0.3, 0.4, 0.5, 2.0]
    assert text["first_s"]["p50"] == pytest.approx(np.percentile(firsts, 50))
    assert text["first_s"]["p99"] == pytest.approx(np.percentile(firsts, 99))
    assert text["goodput"]["met"] == 5  # slow misses ttft, failed never counts
    speech = summary["by_kind"]["speech"]
    assert speech["goodput"]["met"] == 1 and speech["viable_share"] == 0.5
    assert speech["audio_seconds"] == 2.0 and speech["audio_seconds_per_s"] == 0.5
    assert summary["by_kind"]["image"]["goodput"]["met"] == 0  # 1.5 s > 1.0 s
    overall = summary["overall"]["goodput"]
    assert overall["met"] == 6 and overall["share"] == pytest.approx(6 / 10)
    assert overall["requests_per_s"] == 6 / 4.0
    assert not loadgen.meets(slow, {"e2e": 2.9}) and loadgen.meets(slow, {"e2e": 3.0})
    assert not loadgen.meets(fast[0], {"itl": 0.04}) and loadgen.meets(fast[0], {"itl": 0.06})
    text_only = loadgen.format_summary(summary)
    assert "goodput 5" in text_only and "failures {'503': 1}" in text_only


def test_slo_parsing_errors_name_the_keys() -> None:
    assert loadgen.parse_slo("ttft=0.5, e2e=3") == {"ttft": 0.5, "e2e": 3.0}
    assert loadgen.parse_slo(None) == {}
    with pytest.raises(ValueError, match="tpot"):
        loadgen.parse_slo("latency=1")
    with pytest.raises(ValueError, match="not a number"):
        loadgen.parse_slo("ttft=fast")
