"""Qwen3-Omni speech serving: ``python benchmarks/bench_speech_omni.py [--quick]``.

The tiny random Qwen3-Omni (text prompt -> thinker -> talker + code predictor -> code2wav),
greedy, served as ``walkserve.adapters.qwen3_omni:streaming``: code2wav chunks of 8 frames with
4 of left context, the first chunk 4 frames. At concurrency 1, 4 and 8 (``--quick``: 1 and 4),
``c`` requests are submitted at once, two waves per level, and compared with the native
baseline: upstream ``generate()`` called per request, one after another, in a fresh process
(it returns audio only at the end, so its time to first audio is its whole request time).

Reported per level and way:
    ttfa_s               mean time from submit to the first waveform chunk
    audio_s_per_wall_s   audio seconds produced / wall seconds of the wave(s)
    viability            walkserve only: share of waveform chunks that arrive before the audio
                         delivered before them has finished playing (playback starts at the
                         first chunk)

    audio_s_per_cpu_s    audio seconds / CPU seconds (user + system) of the processes doing the
                         work (walkserve: this process and its workers; generate: its
                         process): on a machine shared with other load, wall time measures the
                         load as much as the server, CPU time much less

Audio seconds are counted at the real model's frame rate (12.5 codec frames per second, 80 ms
each), not from the tiny codec's sample count (its 16 samples per frame would make every
request a few milliseconds long). Writes ``benchmarks/results/speech_omni.json``. Timings on a
small shared VM are noisy (+-20% or worse): compare ratios from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from walkserve.benchmarking import write_result

ROOT = Path(__file__).resolve().parents[1]
# The tiny model with its streaming code2wav schedule: the first audio after TINY_FIRST frames,
# then TINY_CHUNK frames per chunk (LeftContext(TINY_CONTEXT, TINY_CHUNK, first=TINY_FIRST)).
FACTORY = "walkserve.adapters.qwen3_omni:streaming"
PLACEMENT = ROOT / "walkserve/adapters/placements_omni/qwen3-omni.2ranks.yaml"
FRAME_SECONDS = 0.08  # Qwen3-Omni's codec: 12.5 frames per second
WAVES = 2


def workload(n: int, max_new: int, max_audio: int, seed: int) -> list[dict[str, Any]]:
    from walkserve.adapters import qwen3_omni as q

    config = q.tiny_config()
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": q.chat_prompt(config, torch.randint(0, 200, (4,), generator=g).tolist()),
            "max_new_tokens": max_new,
            "max_audio_tokens": max_audio,
            "speaker_id": q.TINY_SPEAKER,
        }
        for _ in range(n)
    ]


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and its live descendants, from
    Linux ``/proc`` (``stat`` fields 14 and 15, after the command name)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU seconds)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        procs[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, grown = {os.getpid()}, True
    while grown:
        more = {pid for pid, (parent, _) in procs.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    return sum(procs[pid][1] for pid in tree if pid in procs)


def run_generate(work: list[dict[str, Any]]) -> dict[str, Any]:
    """Upstream generate() per request: (seconds, CPU seconds, frames) of each."""
    from walkserve.adapters import qwen3_omni as q

    walks, _ = q.tiny()
    q.upstream_speech(walks, work[0])  # first-call costs stay out of the timing
    seconds, cpu, frames = [], [], []
    for r in work:
        start, start_cpu = time.perf_counter(), time.process_time()
        _, codes, _ = q.upstream_speech(walks, r)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        frames.append(int(codes.shape[-1]))
    return {"seconds": seconds, "cpu_s": cpu, "frames": frames}


def _waveform_arrivals(handle: Any) -> list[tuple[float, int]]:
    """(arrival time, samples) of each waveform chunk of one request, as it streams."""
    return [
        (time.monotonic(), int(item.value.shape[-1]))
        for item in handle.stream(timeout=600)
        if item.channel == "waveform"
    ]


def run_walkserve(work: list[dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    from walkserve.runtime.server import serve

    out: dict[str, Any] = {}
    with serve(FACTORY, PLACEMENT) as server:
        server.run(work[0], "speak", timeout=600)  # warm-up
        for c in levels:
            ttfa, viable, chunks, frames, wall, cpu = [], 0, 0, 0, 0.0, 0.0
            for wave in range(WAVES):
                reqs = work[wave * c : (wave + 1) * c]
                start, start_cpu = time.monotonic(), tree_cpu_s()
                handles = [server.submit(r, "speak") for r in reqs]
                # One reader per request, so that each chunk's arrival time is its own (read
                # one after another, later requests' chunks would wait for earlier streams).
                with ThreadPoolExecutor(len(handles)) as readers:
                    arrivals = list(readers.map(_waveform_arrivals, handles))
                results = [h.result(timeout=600) for h in handles]
                wall += time.monotonic() - start
                cpu += tree_cpu_s() - start_cpu
                for got, res in zip(arrivals, results):
                    n_frames = int(res["codes"].shape[-1])
                    frames += n_frames
                    samples = max(1, sum(s for _, s in got))
                    ttfa.append(got[0][0] - start)
                    # Playback clock: chunk k must arrive before the audio before it has played.
                    played = 0.0
                    for t, s in got:
                        chunks += 1
                        viable += int(t - got[0][0] <= played + 1e-9)
                        played += s / samples * n_frames * FRAME_SECONDS
            out[str(c)] = {
                "ttfa_s": sum(ttfa) / len(ttfa),
                "audio_s_per_wall_s": frames * FRAME_SECONDS / wall,
                "audio_s_per_cpu_s": frames * FRAME_SECONDS / cpu,
                "viability": viable / max(1, chunks),
                "wall_s": wall,
                "cpu_s": cpu,
                "frames": frames,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4, shorter replies")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-audio-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/speech_omni.json")
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    levels = [1, 4] if args.quick else [1, 4, 8]
    if args.quick:
        args.max_new_tokens, args.max_audio_tokens = 24, 24
    work = workload(WAVES * max(levels), args.max_new_tokens, args.max_audio_tokens, args.seed)
    if args.baseline:
        print(json.dumps(run_generate(work)))
        return

    load_before = os.getloadavg()
    cmd = [sys.executable, __file__, "--baseline", "--seed", str(args.seed)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--max-audio-tokens", str(args.max_audio_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    base = json.loads(proc.stdout.strip().splitlines()[-1])
    native: dict[str, Any] = {}
    for c in levels:
        n = WAVES * c
        seconds, frames = base["seconds"][:n], base["frames"][:n]
        cpu = base["cpu_s"][:n]
        # Requests one after another: request k of a wave waits for the k before it.
        ttfa = []
        for wave in range(WAVES):
            elapsed = 0.0
            for s in seconds[wave * c : (wave + 1) * c]:
                elapsed += s
                ttfa.append(elapsed)
        native[str(c)] = {
            "ttfa_s": sum(ttfa) / len(ttfa),
            "audio_s_per_wall_s": sum(frames) * FRAME_SECONDS / sum(seconds),
            "audio_s_per_cpu_s": sum(frames) * FRAME_SECONDS / sum(cpu),
        }
    served = run_walkserve(work, levels)
    for c in levels:
        w, b = served[str(c)], native[str(c)]
        print(
            f"c={c}: walkserve ttfa {w['ttfa_s']:.3f} s, {w['audio_s_per_wall_s']:.2f} audio s/s, "
            f"viability {w['viability']:.0%} | generate ttfa {b['ttfa_s']:.3f} s, "
            f"{b['audio_s_per_wall_s']:.2f} audio s/s | per CPU s: walkserve "
            f"{w['audio_s_per_cpu_s']:.2f}, generate {b['audio_s_per_cpu_s']:.2f}"
        )
    summary = {
        "benchmark": "speech_omni",
        "quick": args.quick,
        "model": FACTORY,
        "placement": str(PLACEMENT.relative_to(ROOT)),
        "code2wav_chunks": "LeftContext(context=4, chunk=8, first=4)",
        "frame_seconds": FRAME_SECONDS,
        "max_new_tokens": args.max_new_tokens,
        "max_audio_tokens": args.max_audio_tokens,
        "walkserve": served,
        "generate_per_request": native,
        "ttfa_ratio_generate_over_walkserve": {
            c: native[c]["ttfa_s"] / served[c]["ttfa_s"] for c in served
        },
        "throughput_ratio_walkserve_over_generate": {
            c: served[c]["audio_s_per_wall_s"] / native[c]["audio_s_per_wall_s"] for c in served
        },
        "cpu_throughput_ratio_walkserve_over_generate": {
            c: served[c]["audio_s_per_cpu_s"] / native[c]["audio_s_per_cpu_s"] for c in served
        },
    }
    write_result(args.out, summary, load_before)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
