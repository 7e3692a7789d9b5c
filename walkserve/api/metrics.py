"""Prometheus text exposition of the HTTP server's counters and the conductor's stats. Plain
Python, no client library: a few gauges, counters and fixed-bucket histograms.

Streaming viability (streamed speech and chat audio): playback starts when a request's first
audio chunk arrives and plays without pause; a later chunk is on time when it arrives before
the audio delivered before it has finished playing::

    arrivals   t0        t1            t2
    audio      |-- d0 --|-- d1 --|
    chunk 1 on time: t1 <= t0 + d0;  chunk 2 on time: t2 <= t0 + d0 + d1

The gauge is on-time chunks over judged chunks (every chunk but each request's first), summed
over the requests served so far; the same rule as ``benchmarks/loadgen.py``."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from walkserve.runtime.conductor import ConductorStats
from walkserve.runtime.messages import KVStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        suffix = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{suffix} {self.total:.6f}")
        out.append(f"{name}_count{suffix} {self.n}")
        return out


class PlaybackClock:
    """One streamed request's playback: ``arrive(t, seconds)`` per audio chunk, in order;
    ``on_time`` of ``judged`` chunks (the first chunk starts playback and is not judged)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.played = 0.0  # seconds of audio delivered so far
        self.on_time = 0
        self.judged = 0

    def arrive(self, t: float, seconds: float) -> None:
        if seconds <= 0:
            return  # an empty chunk plays nothing and is not judged
        if self.start is None:
            self.start = t
        else:
            self.judged += 1
            self.on_time += int(t <= self.start + self.played)
        self.played += seconds


class Metrics:
    """Thread-safe; observed from the event loop and from pool threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency: dict[str, Histogram] = {}
        self.first_token = Histogram()
        self.first_audio = Histogram()
        self.inter_token = Histogram()
        self.real_time_factor = Histogram()
        self.chunks_on_time = 0
        self.chunks_judged = 0
        self.requests: dict[tuple[str, int], int] = {}
        self.rejected_full = 0
        self.cancelled = 0

    def observe_latency(self, walk: str, seconds: float) -> None:
        with self._lock:
            self.latency.setdefault(walk, Histogram()).observe(seconds)

    def observe_first(self, kind: str, seconds: float) -> None:
        with self._lock:
            (self.first_audio if kind == "audio" else self.first_token).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        with self._lock:
            self.inter_token.observe(seconds)

    def observe_real_time_factor(self, wall_s: float, audio_s: float) -> None:
        """Seconds of computing per second of audio (< 1: faster than real time)."""
        if audio_s > 0:
            with self._lock:
                self.real_time_factor.observe(wall_s / audio_s)

    def observe_playback(self, clock: PlaybackClock) -> None:
        """A finished streamed audio response's chunks (see the module docstring)."""
        with self._lock:
            self.chunks_on_time += clock.on_time
            self.chunks_judged += clock.judged

    def count(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def render(
        self,
        queued: int,
        max_queued: int | None,
        stats: ConductorStats,
        kv: Mapping[int, Sequence[KVStats]] | None = None,
    ) -> str:
        with self._lock:
            lines = [
                "# HELP walkserve_queued_requests Admitted HTTP requests not yet finished.",
                "# TYPE walkserve_queued_requests gauge",
                f"walkserve_queued_requests {queued}",
                "# HELP walkserve_max_queued_requests The --max-queued limit (0: none).",
                "# TYPE walkserve_max_queued_requests gauge",
                f"walkserve_max_queued_requests {max_queued or 0}",
                "# HELP walkserve_running_requests Requests live in the conductor.",
                "# TYPE walkserve_running_requests gauge",
                f"walkserve_running_requests {stats.live_requests}",
                "# HELP walkserve_in_flight_work_items Work items dispatched, not completed.",
                "# TYPE walkserve_in_flight_work_items gauge",
                f"walkserve_in_flight_work_items {stats.in_flight}",
                "# TYPE walkserve_buffered_stream_items gauge",
                f"walkserve_buffered_stream_items {stats.buffered_stream_items}",
                "# HELP walkserve_speculated_steps_total Loop iterations started before the"
                " previous stop was known.",
                "# TYPE walkserve_speculated_steps_total counter",
                f"walkserve_speculated_steps_total {stats.speculated_steps}",
                "# HELP walkserve_wasted_steps_total Speculative iterations discarded.",
                "# TYPE walkserve_wasted_steps_total counter",
                f"walkserve_wasted_steps_total {stats.wasted_steps}",
                "# TYPE walkserve_rejected_queue_full_total counter",
                f"walkserve_rejected_queue_full_total {self.rejected_full}",
                "# HELP walkserve_cancelled_requests_total Requests ended early: the client"
                " left or a stop string matched.",
                "# TYPE walkserve_cancelled_requests_total counter",
                f"walkserve_cancelled_requests_total {self.cancelled}",
                "# TYPE walkserve_http_requests_total counter",
            ]
            lines += _kv_lines(kv or {})
            for (route, status), n in sorted(self.requests.items()):
                lines.append(
                    f'walkserve_http_requests_total{{route="{route}",code="{status}"}} {n}'
                )
            lines.append("# HELP walkserve_request_latency_seconds Request latency by entry walk.")
            lines.append("# TYPE walkserve_request_latency_seconds histogram")
            for walk, hist in sorted(self.latency.items()):
                lines += hist.lines("walkserve_request_latency_seconds", f'walk="{walk}"')
            lines.append("# TYPE walkserve_time_to_first_token_seconds histogram")
            lines += self.first_token.lines("walkserve_time_to_first_token_seconds")
            lines.append("# TYPE walkserve_time_to_first_audio_seconds histogram")
            lines += self.first_audio.lines("walkserve_time_to_first_audio_seconds")
            lines.append("# HELP walkserve_inter_token_latency_seconds Between a request's tokens.")
            lines.append("# TYPE walkserve_inter_token_latency_seconds histogram")
            lines += self.inter_token.lines("walkserve_inter_token_latency_seconds")
            lines.append(
                "# HELP walkserve_real_time_factor Speech: request seconds per second of audio."
            )
            lines.append("# TYPE walkserve_real_time_factor histogram")
            lines += self.real_time_factor.lines("walkserve_real_time_factor")
            viability = self.chunks_on_time / self.chunks_judged if self.chunks_judged else 1.0
            lines += [
                "# HELP walkserve_streaming_viability Streamed audio: share of chunks (after"
                " each request's first) that arrived before the audio sent before them had"
                " finished playing (1 when none was judged yet).",
                "# TYPE walkserve_streaming_viability gauge",
                f"walkserve_streaming_viability {viability:.6f}",
                "# TYPE walkserve_audio_chunks_on_time_total counter",
                f"walkserve_audio_chunks_on_time_total {self.chunks_on_time}",
                "# TYPE walkserve_audio_chunks_judged_total counter",
                f"walkserve_audio_chunks_judged_total {self.chunks_judged}",
            ]
        return "\n".join(lines) + "\n"


def _kv_lines(kv: Mapping[int, Sequence[KVStats]]) -> list[str]:
    """Paged KV pools per rank and component (as of each worker's last heartbeat)."""
    series = [
        ("kv_pages_in_use", "gauge", "KV pages held by live requests.", "pages_in_use"),
        ("kv_pages_cached", "gauge", "Free KV pages kept for prefix reuse.", "pages_cached"),
        ("kv_pages", "gauge", "KV pages in the pool.", "num_pages"),
        ("kv_evictions_total", "counter", "Sequences evicted and recomputed.", "evictions"),
        (
            "kv_prefix_hits_total",
            "counter",
            "Full pages reused from the prefix cache.",
            "prefix_hits",
        ),
    ]
    lines: list[str] = []
    for name, kind, doc, field_name in series:
        lines += [f"# HELP walkserve_{name} {doc}", f"# TYPE walkserve_{name} {kind}"]
        for rank, pools in sorted(kv.items()):
            for pool in pools:
                labels = f'rank="{rank}",component="{pool.component}"'
                lines.append(f"walkserve_{name}{{{labels}}} {getattr(pool, field_name)}")
    return lines
