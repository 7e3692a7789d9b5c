"""``/metrics``: the server's figures in Prometheus text, through ``prometheus_client`` (one
registry per app). Names and labels follow vLLM's (``vllm:prompt_tokens_total``,
``vllm:time_to_first_token_seconds``, ... with a ``model_name`` label) under the prefix
``walkserve:``, so a vLLM dashboard works by changing the prefix::

    walkserve:num_requests_running         gauge      requests live in the conductor
    walkserve:num_requests_waiting         gauge      admitted HTTP requests not yet submitted
    walkserve:prompt_tokens_total          counter    prompt tokens of finished text requests
    walkserve:generation_tokens_total      counter    tokens they generated
    walkserve:request_success_total        counter    finished requests by finished_reason
    walkserve:time_to_first_token_seconds  histogram  submit -> first token
    walkserve:inter_token_latency_seconds  histogram  between a request's tokens
    walkserve:e2e_request_latency_seconds  histogram  submit -> last output, by walk
    walkserve:request_queue_time_seconds   histogram  HTTP arrival -> admitted by the conductor
    walkserve:kv_cache_usage_perc          gauge      pages in use / pages, per rank and pool
    walkserve:prefix_cache_hits_total      counter    full KV pages reused, per rank and pool

and walkserve's own beside them: KV pages, evictions, speculation (speculated and wasted
steps), speech (time to first audio, real-time factor, streaming viability), admission
(queued, limit, 503s), cancellations, and HTTP responses by route *template* and status.

Streaming viability (streamed speech and chat audio): playback starts when a request's first
audio chunk arrives and plays without pause; a later chunk is on time when it arrives before
the audio delivered before it has finished playing::
Streaming viability (streamed speech and chat audio): playback starts when a request's first
audio chunk arrives and plays without pause; a later chunk is on time when it arrives before
the audio delivered before it has finished playing::

    arrivals   t0        t1            t2
    audio      |-- d0 --|-- d1 --|
    chunk 1 on time: t1 <= t0 + d0;  chunk 2 on time: t2 <= t0 + d0 + d1

The gauge is on-time chunks over judged chunks (every chunk but each request's first), summed
over the requests served so far; the same rule as ``benchmarks/loadgen.py``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from walkserve.runtime.conductor import ConductorStats
from walkserve.runtime.messages import KVStats

disable_created_metrics()  # no *_created series (vLLM does the same)
P = "walkserve:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
    """Thread-safe (prometheus_client's own locks); observed from the event loop and from
    pool threads. ``model_name``: the label every series carries."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            f"{P}prompt_tokens", "Prompt tokens of finished text requests.", m, registry=r
        )
        self.generation_tokens = Counter(
            f"{P}generation_tokens", "Generated tokens.", m, registry=r
        )
        self.success = Counter(
            f"{P}request_success", "Finished requests.", [*m, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            f"{P}time_to_first_token_seconds",
            "Submit to first token.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{P}inter_token_latency_seconds",
            "Between a request's tokens.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{P}e2e_request_latency_seconds", "Submit to last output, by entry walk.", [*m, "walk"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            f"{P}request_queue_time_seconds", "HTTP arrival to admission by the conductor.", m,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.first_audio = Histogram(
            f"{P}time_to_first_audio_seconds",
            "Submit to first audio chunk.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            f"{P}real_time_factor", "Speech: request seconds per second of audio.", m,
            buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0), registry=r,
        )  # fmt: skip
        self.chunks_on_time = Counter(
            f"{P}audio_chunks_on_time", "Streamed audio chunks on time.", m, registry=r
        )
        self.chunks_judged = Counter(
            f"{P}audio_chunks_judged",
            "Streamed audio chunks judged (all but each first).",
            m,
            registry=r,
        )
        self.viability = Gauge(
            f"{P}streaming_viability",
            "Streamed audio: share of chunks (after each request's first) that arrived before the"
            " audio sent before them had finished playing (1 when none was judged yet).",
            m,
            registry=r,
        )
        self.viability.labels(model_name).set(1.0)
        self.cancelled = Counter(
            f"{P}cancelled_requests",
            "Requests ended early: the client left or a stop string matched.",
            m,
            registry=r,
        )
        self.rejected = Counter(
            f"{P}rejected_queue_full", "Requests answered 503 at --max-queued.", m, registry=r
        )
        self.http = Counter(
            f"{P}http_requests",
            "HTTP responses by route template and status.",
            [*m, "route", "code"],
            registry=r,
        )
        self._snapshot = _Snapshot(model_name)
        r.register(self._snapshot)
        for counter in (self.prompt_tokens, self.generation_tokens, self.cancelled, self.rejected):
            counter.labels(model_name)  # present (at 0) before the first observation

    # ------------------------------------------------------------ observations

    def observe_latency(self, walk: str, seconds: float, finished_reason: str = "stop") -> None:
        self.e2e.labels(self.model_name, walk).observe(seconds)
        self.success.labels(self.model_name, finished_reason).inc()

    def observe_first(self, kind: str, seconds: float) -> None:
        (self.first_audio if kind == "audio" else self.ttft).labels(self.model_name).observe(
            seconds
        )

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def observe_queue(self, seconds: float) -> None:
        self.queue.labels(self.model_name).observe(seconds)

    def observe_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt)
        self.generation_tokens.labels(self.model_name).inc(generated)

    def observe_real_time_factor(self, wall_s: float, audio_s: float) -> None:
        """Seconds of computing per second of audio (< 1: faster than real time)."""
        if audio_s > 0:
            self.rtf.labels(self.model_name).observe(wall_s / audio_s)

    def observe_playback(self, clock: PlaybackClock) -> None:
        """A finished streamed audio response's chunks (see the module docstring)."""
        on_time = self.chunks_on_time.labels(self.model_name)
        judged = self.chunks_judged.labels(self.model_name)
        on_time.inc(clock.on_time)
        judged.inc(clock.judged)
        total = judged._value.get()
        self.viability.labels(self.model_name).set(on_time._value.get() / total if total else 1.0)

    def count(self, route: str, status: int) -> None:
        self.http.labels(self.model_name, route, str(status)).inc()

    def count_cancelled(self) -> None:
        self.cancelled.labels(self.model_name).inc()

    def count_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def render(
        self,
        queued: int,
        max_queued: int | None,
        stats: ConductorStats,
        kv: Mapping[int, Sequence[KVStats]] | None = None,
    ) -> str:
        """The exposition text, with the conductor's ``stats`` and the KV pools ``kv`` (as of
        each worker's last heartbeat) read now."""
        self._snapshot.set(queued, max_queued, stats, kv or {})
        return generate_latest(self.registry).decode("utf-8")


class _Snapshot(Collector):
    """The figures read at scrape time: the conductor's stats and the KV pools."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.value: tuple[int, int | None, ConductorStats | None, Mapping[int, Sequence[KVStats]]] = (
            0, None, None, {},
        )  # fmt: skip

    def set(self, *value: Any) -> None:
        self.value = value  # type: ignore[assignment]

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        queued, max_queued, stats, kv = self.value
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{P}{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{P}{name}", doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_waiting", "Admitted HTTP requests not yet finished.", queued)
        yield gauge("max_queued_requests", "The --max-queued limit (0: none).", max_queued or 0)
        if stats is not None:
            yield gauge(
                "num_requests_running", "Requests live in the conductor.", stats.live_requests
            )
            yield gauge(
                "in_flight_work_items", "Work items dispatched, not completed.", stats.in_flight
            )
            yield gauge(
                "buffered_stream_items", "Stream items not yet taken.", stats.buffered_stream_items
            )
            yield counter(
                "speculated_steps", "Loop iterations started before the previous stop was known.",
                stats.speculated_steps,
            )  # fmt: skip
            yield counter("wasted_steps", "Speculative iterations discarded.", stats.wasted_steps)
        labels = ["model_name", "rank", "component"]
        yield from _component_counters(m, getattr(stats, "ranks", None) or {})
        series = [
            (
                "kv_pages_in_use",
                GaugeMetricFamily,
                "KV pages held by live requests.",
                "pages_in_use",
            ),
            (
                "kv_pages_cached",
                GaugeMetricFamily,
                "Free KV pages kept for prefix reuse.",
                "pages_cached",
            ),
            ("kv_pages", GaugeMetricFamily, "KV pages in the pool.", "num_pages"),
            (
                "num_preemptions",
                CounterMetricFamily,
                "Sequences evicted and recomputed.",
                "evictions",
            ),
            (
                "prefix_cache_hits",
                CounterMetricFamily,
                "Full KV pages reused from the prefix cache.",
                "prefix_hits",
            ),
        ]
        for name, family, doc, field_name in series:
            f = family(f"{P}{name}", doc, labels=labels)
            for rank, pools in sorted(kv.items()):
                for pool in pools:
                    f.add_metric([*m, str(rank), pool.component], getattr(pool, field_name))
            yield f
        usage = GaugeMetricFamily(
            f"{P}kv_cache_usage_perc", "KV pages in use / pages (0..1).", labels=labels
        )
        for rank, pools in sorted(kv.items()):
            for pool in pools:
                share = pool.pages_in_use / pool.num_pages if pool.num_pages else 0.0
                usage.add_metric([*m, str(rank), pool.component], share)
        yield usage


#: components' counters exported (``RankStatsReply.counters``), as vLLM names them
COMPONENT_COUNTERS = {
    "mm_cache_queries": "Images looked up in a vision tower's encoder cache.",
    "mm_cache_hits": "Images found in a vision tower's encoder cache (not encoded again).",
    "cohort_steps": "Loop steps run as one call over a cohort's joint state (component "
    "loop_stepper).",
    "lane_steps": "Cohort steps made by a rank's fast lane, with no scheduling pass.",
    "joined_steps": "Loop steps whose requests' calls were joined into one call.",
    "exported": "Held values a rank wrote to its Mooncake send buffer for readers on other "
    "hosts (component objects).",
    "exported_bytes": "Bytes of those values.",
    "holds": "Bursts of region starts a rank held for their last chunk (component burst).",
}


def _component_counters(m: list[str], ranks: Mapping[int, Any]) -> Iterator[Any]:
    """One counter family per ``COMPONENT_COUNTERS`` name, a series per rank and component."""
    for name, doc in COMPONENT_COUNTERS.items():
        family = CounterMetricFamily(f"{P}{name}", doc, labels=["model_name", "rank", "component"])
        for rank, reply in sorted(ranks.items()):
            for key, value in sorted(reply.counters.items()):
                component, _, counter = key.rpartition("/")
                if counter == name:
                    family.add_metric([*m, str(rank), component], value)
        yield family


def read_metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` whose labels include ``labels`` in exposition ``text``
    (parsed with prometheus_client's own parser); None if there is none. For tests and
    load generators."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
