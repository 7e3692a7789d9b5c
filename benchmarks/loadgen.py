"""The load generator: drives a running walkserve server over HTTP and measures what a client
sees. ``python -m benchmarks --url http://127.0.0.1:8000 ...`` or ``walkserve bench ...``.

Owns: the seeded workload (which requests, in which order, with which lengths), the two arrival
modes, the HTTP clients per route (streamed bodies parsed as they arrive), the per-request
records and their summary (percentiles, throughput, real-time factor, streaming viability,
goodput under service targets). Crosses the boundary: a base URL in, JSON-ready dicts out; no
walkserve internals are imported, so any OpenAI-compatible server can be measured.

Arrival modes::

    closed   --concurrency C   C clients, each sends its next request when the last one ends
    open     --rate R          arrivals at R requests/s: Poisson (--burstiness 1), or gamma
                               inter-arrival gaps with shape --burstiness (< 1: burstier)

Request kinds and what is recorded for each (times in seconds from the request's send)::

    text    POST /v1/completions, stream, return_token_ids: first token, every token's arrival
    chat    POST /v1/chat/completions, stream: first content chunk, chunk arrivals
    speech  POST /v1/audio/speech, stream, wav: first audio byte, each audio chunk's arrival
            and duration (from the WAV header's rate), so on-time playback can be judged
    image   POST /v1/images/generations: latency of the whole image
    walk    POST /v1/walks/{walk} with fixed JSON inputs, stream: first event, end

Streaming viability of a speech request: playback starts when the first audio arrives and
plays without pause; a chunk is on time when it arrives before the audio delivered before it
has finished playing. The share of on-time chunks (after the first) is the request's
viability; 1.0 means a listener hears no gap.

Goodput: requests that succeeded and met every service target that applies to them
(``--slo ttft=0.5,tpot=0.1,e2e=20,image=5,viability=1``), as a share and per second of wall
time. Warm-up requests (``--warmup``) run first and are left out of every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import string
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

KINDS = ("text", "chat", "speech", "image", "walk")

# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Lengths:
    """An integer length distribution: ``fixed`` (lo == hi) or ``uniform`` in [lo, hi]."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"lengths need 1 <= lo <= hi, got [{self.lo}, {self.hi}]")

    @staticmethod
    def parse(text: str) -> Lengths:
        """``"32"`` (fixed) or ``"16:256"`` / ``"uniform:16:256"`` (uniform, inclusive)."""
        parts = text.removeprefix("uniform:").split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"lengths {text!r}: write N or LO:HI (integers)") from None
        if len(values) == 1:
            return Lengths(values[0], values[0])
        if len(values) == 2:
            return Lengths(values[0], values[1])
        raise ValueError(f"lengths {text!r}: write N or LO:HI")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class Workload:
    """What to send: a request mix (kind -> weight; ``walk:NAME`` for a walk) and per-kind
    length distributions, all drawn from one seeded generator."""

    mix: tuple[tuple[str, float], ...] = (("text", 1.0),)
    prompt_len: Lengths = Lengths(16, 64)  # text/chat prompt tokens (ids) or words (chat)
    output_len: Lengths = Lengths(16, 64)  # text/chat max_tokens
    speech_len: Lengths = Lengths(8, 32)  # speech input characters
    speech_tokens: Lengths = Lengths(16, 32)  # speech max_tokens
    image_len: Lengths = Lengths(8, 32)  # image prompt characters
    token_range: tuple[int, int] = (3, 259)  # prompt ids drawn from [lo, hi): the model's vocab
    walk_inputs: tuple[tuple[str, str], ...] = ()  # walk name -> JSON inputs
    model: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.mix:
            raise ValueError("the request mix is empty; give e.g. --mix text=1")
        walks = dict(self.walk_inputs)
        for kind, weight in self.mix:
            base = kind.split(":", 1)[0]
            if base not in KINDS:
                raise ValueError(f"unknown request kind {kind!r}; use one of {list(KINDS)}")
            if base == "walk" and kind.split(":", 1)[-1] not in walks:
                raise ValueError(f"{kind!r} needs its inputs: --walk-inputs NAME='{{...}}'")
            if not weight > 0:
                raise ValueError(f"the weight of {kind!r} must be > 0, got {weight}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token range [{lo}, {hi}) is empty")

    @staticmethod
    def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
        """``"text=0.6,speech=0.2,image=0.2,walk:speak=1"``; a bare kind weighs 1."""
        out = []
        for item in text.split(","):
            if not item.strip():
                continue
            kind, _, weight = item.strip().partition("=")
            try:
                out.append((kind, float(weight) if weight else 1.0))
            except ValueError:
                raise ValueError(f"mix entry {item!r}: write KIND=WEIGHT") from None
        return tuple(out)


@dataclass(frozen=True)
class Planned:
    """One request to send: its route, JSON body and what the workload asked of it."""

    index: int
    kind: str  # text | chat | speech | image | walk
    route: str
    body: dict[str, Any]
    prompt_len: int
    max_tokens: int | None
    warmup: bool = False


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=4)) for _ in range(n))


def _chars(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase + " ", k=n - 1)) + "a"


def plan(workload: Workload, n: int, warmup: int = 0) -> list[Planned]:
    """``warmup`` then ``n`` requests drawn from ``workload``: the same seed gives the same
    requests in the same order."""
    if n < 0 or warmup < 0:
        raise ValueError(f"request counts must be >= 0, got n={n}, warmup={warmup}")
    rng = random.Random(workload.seed)
    kinds = [k for k, _ in workload.mix]
    weights = [w for _, w in workload.mix]
    walks = {name: json.loads(inputs) for name, inputs in workload.walk_inputs}
    model = {"model": workload.model} if workload.model else {}
    out = []
    for i in range(warmup + n):
        kind = rng.choices(kinds, weights)[0]
        base, _, walk = kind.partition(":")
        if base == "text":
            p, m = workload.prompt_len.sample(rng), workload.output_len.sample(rng)
            lo, hi = workload.token_range
            ids = [rng.randrange(lo, hi) for _ in range(p)]
            body: dict[str, Any] = {
                "prompt": ids,
                "max_tokens": m,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            }
            out.append(Planned(i, base, "/v1/completions", {**model, **body}, p, m, i < warmup))
        elif base == "chat":
            p, m = workload.prompt_len.sample(rng), workload.output_len.sample(rng)
            body = {
                "messages": [{"role": "user", "content": _words(rng, p)}],
                "max_tokens": m,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            route = "/v1/chat/completions"
            out.append(Planned(i, base, route, {**model, **body}, p, m, i < warmup))
        elif base == "speech":
            p, m = workload.speech_len.sample(rng), workload.speech_tokens.sample(rng)
            body = {"input": _chars(rng, p), "max_tokens": m, "stream": True}
            body["response_format"] = "wav"
            out.append(Planned(i, base, "/v1/audio/speech", {**model, **body}, p, m, i < warmup))
        elif base == "image":
            p = workload.image_len.sample(rng)
            body = {"prompt": _chars(rng, p), "seed": rng.randrange(2**31)}
            route = "/v1/images/generations"
            out.append(Planned(i, base, route, {**model, **body}, p, None, i < warmup))
        else:
            body = {"inputs": walks[walk], "stream": True}
            out.append(Planned(i, base, f"/v1/walks/{walk}", body, 0, None, i < warmup))
    return out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` open-loop arrivals at ``rate`` per second:
    gamma-distributed gaps with shape ``burstiness`` and mean ``1 / rate`` (shape 1: a
    Poisson process). The first request goes at 0."""
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0 (1 = Poisson), got {burstiness}")
    rng = random.Random(seed + 7919)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


# ---------------------------------------------------------------------------- parsing


class SSEParser:
    """Server-sent events from byte chunks split anywhere: ``feed`` returns the ``data``
    payloads of the events completed so far (multi-line data joined by newlines; comments,
    ``event:``/``id:`` fields and blank keep-alives ignored)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return events
            line = self._buffer[:cut].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[cut + 1 :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass(frozen=True)
class WavFormat:
    sample_rate: int
    channels: int
    bytes_per_sample: int
    header_bytes: int

    def seconds(self, data_bytes: int) -> float:
        return data_bytes / (self.sample_rate * self.channels * self.bytes_per_sample)


def wav_format(head: bytes) -> WavFormat | None:
    """The format of a WAV stream from its first bytes; None until the ``data`` chunk's header
    has arrived. Raises ValueError on something that is not a RIFF/WAVE stream."""
    if len(head) < 12:
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise ValueError("the speech response is not a WAV stream (no RIFF/WAVE header)")
    pos, fmt = 12, None
    while len(head) >= pos + 8:
        tag, size = head[pos : pos + 4], int.from_bytes(head[pos + 4 : pos + 8], "little")
        if tag == b"data":
            if fmt is None:
                raise ValueError("the WAV stream has no fmt chunk before its data")
            return WavFormat(fmt[1], fmt[0], fmt[2], pos + 8)
        if tag == b"fmt ":
            if len(head) < pos + 24:
                return None
            channels = int.from_bytes(head[pos + 10 : pos + 12], "little")
            rate = int.from_bytes(head[pos + 12 : pos + 16], "little")
            bits = int.from_bytes(head[pos + 22 : pos + 24], "little")
            fmt = (channels, rate, bits // 8)
        pos += 8 + size
    return None


# ---------------------------------------------------------------------------- records


@dataclass
class Record:
    """What one request did, as the client saw it (seconds from its send)."""

    index: int
    kind: str
    route: str
    prompt_len: int
    max_tokens: int | None
    start: float = 0.0  # seconds from the run's start
    ok: bool = False
    status: int | None = None  # HTTP status; None: no response (connection error, timeout)
    error: str | None = None
    first: float | None = None  # first token / audio byte / event; images: the whole image
    end: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    token_ids: list[int] = field(default_factory=list)
    output_tokens: int = 0
    audio_seconds: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # speech: audio chunk arrivals
    chunk_seconds: list[float] = field(default_factory=list)  # speech: audio per chunk
    response_bytes: int = 0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def rtf(self) -> float | None:
        """Real-time factor: generation time over audio duration (< 1: faster than real time)."""
        if self.end is None or self.audio_seconds <= 0:
            return None
        return self.end / self.audio_seconds

    @property
    def viability(self) -> float | None:
        """Share of audio chunks after the first that arrived before the audio delivered before
        them had finished playing (playback from the first chunk, without pauses)."""
        if not self.chunk_times:
            return None
        if len(self.chunk_times) == 1:
            return 1.0
        t0, played, on_time = self.chunk_times[0], 0.0, 0
        for k in range(1, len(self.chunk_times)):
            played += self.chunk_seconds[k - 1]
            on_time += self.chunk_times[k] <= t0 + played
        return on_time / (len(self.chunk_times) - 1)


# ---------------------------------------------------------------------------- clients


async def _send(client: Any, p: Planned, rec: Record, timeout: float) -> None:
    import httpx

    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    try:
        async with client.stream("POST", p.route, json=p.body, timeout=timeout) as response:
            rec.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                rec.error = body[:300]
                rec.end = now()
                return
            if p.kind == "speech":
                await _read_speech(response, rec, now)
            elif p.kind == "image":
                data = await response.aread()
                rec.response_bytes = len(data)
                images = json.loads(data).get("data", [])
                if not images or not images[0].get("b64_json"):
                    raise ValueError("the image response has no data[0].b64_json")
                rec.first = now()
            else:
                await _read_events(response, p, rec, now)
            rec.end = now()
            rec.ok = rec.error is None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.end = now()


async def _read_events(response: Any, p: Planned, rec: Record, now: Callable[[], float]) -> None:
    parser = SSEParser()
    usage: int | None = None
    async for chunk in response.aiter_bytes():
        rec.response_bytes += len(chunk)
        for data in parser.feed(chunk):
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                rec.error = str(event["error"].get("message", event["error"]))[:300]
                continue
            if p.kind == "walk":
                if rec.first is None:
                    rec.first = now()
                continue
            if event.get("usage"):
                usage = int(event["usage"]["completion_tokens"])
            for choice in event.get("choices", []):
                if p.kind == "text":
                    ids = choice.get("token_ids") or []
                    rec.token_ids += [int(t) for t in ids]
                    n = len(ids)
                else:
                    n = 1 if choice.get("delta", {}).get("content") else 0
                if n:
                    t = now()
                    if rec.first is None:
                        rec.first = t
                    rec.token_times += [t] * n
    rec.output_tokens = usage if usage is not None else len(rec.token_times)


async def _read_speech(response: Any, rec: Record, now: Callable[[], float]) -> None:
    head, fmt, leftover = b"", None, 0
    async for chunk in response.aiter_bytes():
        rec.response_bytes += len(chunk)
        if fmt is None:
            head += chunk
            fmt = wav_format(head)
            if fmt is None:
                continue
            audio = len(head) - fmt.header_bytes
        else:
            audio = len(chunk)
        if audio <= 0:
            continue
        t = now()
        whole = (audio + leftover) // (fmt.bytes_per_sample * fmt.channels)
        leftover = (audio + leftover) % (fmt.bytes_per_sample * fmt.channels)
        seconds = whole / fmt.sample_rate
        if rec.first is None:
            rec.first = t
        rec.chunk_times.append(t)
        rec.chunk_seconds.append(seconds)
        rec.audio_seconds += seconds


class Progress:
    """A one-line progress bar on a terminal; a line per 10% elsewhere (logs, pipes)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self._shown = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        tenth = 10 * self.done // max(self.total, 1)
        if not self.tty and tenth == self._shown and self.done != self.total:
            return
        self._shown = tenth
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"{self.label} [{bar}] {self.done}/{self.total}"
            f" ({self.failed} failed) {time.perf_counter() - self.t0:6.1f} s"
        )
        if self.tty:
            end = "\n" if self.done == self.total else ""
            self.stream.write(f"\r\x1b[K{line}{end}")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


@dataclass(frozen=True)
class Arrivals:
    """Closed loop at ``concurrency``, or open loop at ``rate`` (then ``concurrency`` caps the
    requests in flight; None: no cap)."""

    concurrency: int | None = 8
    rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.rate is None and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("a closed loop needs --concurrency >= 1 (or give --rate)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")

    @property
    def mode(self) -> str:
        return "closed" if self.rate is None else "open"


async def run(
    url: str,
    requests: Sequence[Planned],
    arrivals: Arrivals,
    seed: int = 0,
    timeout: float = 300.0,
    api_key: str | None = None,
    progress: bool = True,
    schedule: Sequence[float] | None = None,
) -> tuple[list[Record], float]:
    """Send ``requests`` (warm-up ones first, one at a time, not recorded); return the records
    of the rest and the wall time they took. ``schedule``: explicit open-loop send times (s from
    the start), one per measured request, instead of drawing them from ``arrivals``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits) as client:
        for p in (p for p in requests if p.warmup):
            await _send(client, p, Record(p.index, p.kind, p.route, p.prompt_len, None), timeout)
        measured = [p for p in requests if not p.warmup]
        records = [Record(p.index, p.kind, p.route, p.prompt_len, p.max_tokens) for p in measured]
        bar = Progress(len(measured), f"{arrivals.mode} loop") if progress else None
        t_start = time.perf_counter()

        async def one(i: int) -> None:
            records[i].start = time.perf_counter() - t_start
            await _send(client, measured[i], records[i], timeout)
            if bar is not None:
                bar.update(records[i].ok)

        if arrivals.rate is None and schedule is None:
            assert arrivals.concurrency is not None
            queue = iter(range(len(measured)))

            async def client_loop() -> None:
                for i in queue:
                    await one(i)

            await asyncio.gather(*(client_loop() for _ in range(arrivals.concurrency)))
        else:
            if schedule is not None:
                if len(schedule) != len(measured):
                    raise ValueError(
                        f"the schedule has {len(schedule)} times for {len(measured)} requests"
                    )
                times = list(schedule)
            else:
                assert arrivals.rate is not None
                times = arrival_times(len(measured), arrivals.rate, arrivals.burstiness, seed)
            cap = asyncio.Semaphore(arrivals.concurrency or len(measured) or 1)

            async def scheduled(i: int) -> None:
                delay = t_start + times[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with cap:
                    await one(i)

            await asyncio.gather(*(scheduled(i) for i in range(len(measured))))
        wall = time.perf_counter() - t_start
    return records, wall


# ---------------------------------------------------------------------------- summary


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics;
    None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, mean, p50, p95, p99 and max of ``values``."""
    return {
        "n": len(values),
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


SLO_KEYS = {
    "ttft": "first token / audio / event, s (text, chat, speech, walk)",
    "tpot": "mean time per output token after the first, s (text, chat)",
    "itl": "largest gap between two output tokens, s (text, chat)",
    "e2e": "end-to-end latency, s (every request)",
    "image": "image latency, s (image)",
    "viability": "minimum share of on-time audio chunks, 0-1 (speech)",
    "rtf": "maximum real-time factor (speech)",
}


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=0.5,tpot=0.1"`` -> ``{"ttft": 0.5, "tpot": 0.1}``; keys from ``SLO_KEYS``."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.strip().partition("=")
        if not sep or key not in SLO_KEYS:
            known = ", ".join(f"{k} ({v})" for k, v in SLO_KEYS.items())
            raise ValueError(f"service target {item!r}: write KEY=VALUE with KEY one of {known}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"service target {item!r}: {value!r} is not a number") from None
    return out


def meets(rec: Record, slo: dict[str, float]) -> bool:
    """Whether ``rec`` succeeded and met every target in ``slo`` that applies to its kind."""
    if not rec.ok or rec.end is None:
        return False
    streams = rec.kind in ("text", "chat", "speech", "walk")
    checks: list[tuple[str, float | None, bool]] = [
        ("ttft", rec.first if streams else None, False),
        ("tpot", rec.tpot if rec.kind in ("text", "chat") else None, False),
        ("itl", max(rec.itls, default=0.0) if rec.kind in ("text", "chat") else None, False),
        ("e2e", rec.end, False),
        ("image", rec.end if rec.kind == "image" else None, False),
        ("viability", rec.viability if rec.kind == "speech" else None, True),
        ("rtf", rec.rtf if rec.kind == "speech" else None, False),
    ]
    for key, value, at_least in checks:
        if key in slo and value is not None:
            if at_least and value < slo[key]:
                return False
            if not at_least and value > slo[key]:
                return False
    return True


def summarize(
    records: Sequence[Record], wall_s: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    """Figures over ``records`` (a run that took ``wall_s``): overall and per kind."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be > 0 s, got {wall_s}")
    slo = slo or {}

    def block(recs: Sequence[Record]) -> dict[str, Any]:
        ok = [r for r in recs if r.ok]
        statuses: dict[str, int] = {}
        for r in recs:
            if not r.ok:
                key = str(r.status) if r.status is not None else "no response"
                statuses[key] = statuses.get(key, 0) + 1
        good = [r for r in recs if meets(r, slo)]
        tokens = sum(r.output_tokens for r in ok)
        audio = sum(r.audio_seconds for r in ok)
        out: dict[str, Any] = {
            "requests": len(recs),
            "succeeded": len(ok),
            "failed": len(recs) - len(ok),
            "failures_by_status": statuses,
            "requests_per_s": len(ok) / wall_s,
            "e2e_s": stats([r.end for r in ok if r.end is not None]),
            "first_s": stats([r.first for r in ok if r.first is not None]),
        }
        if any(r.kind in ("text", "chat") for r in recs):
            out["output_tokens"] = tokens
            out["output_tokens_per_s"] = tokens / wall_s
            out["tpot_s"] = stats([t for r in ok if (t := r.tpot) is not None])
            out["itl_s"] = stats([g for r in ok for g in r.itls])
        if any(r.kind == "speech" for r in recs):
            out["audio_seconds"] = audio
            out["audio_seconds_per_s"] = audio / wall_s
            out["rtf"] = stats([x for r in ok if (x := r.rtf) is not None])
            viab = [v for r in ok if (v := r.viability) is not None]
            out["viability"] = stats(viab)
            out["viable_share"] = sum(v >= 1.0 for v in viab) / len(viab) if viab else None
        if slo:
            out["goodput"] = {
                "met": len(good),
                "share": len(good) / len(recs) if recs else None,
                "requests_per_s": len(good) / wall_s,
            }
        return out

    kinds = sorted({r.kind for r in records})
    return {
        "wall_s": wall_s,
        "slo": slo,
        "overall": block(records),
        "by_kind": {k: block([r for r in records if r.kind == k]) for k in kinds},
    }


def record_dict(rec: Record) -> dict[str, Any]:
    """A record as JSON (without token ids, which only tests compare)."""
    out = asdict(rec)
    del out["token_ids"]
    out.update(tpot=rec.tpot, rtf=rec.rtf, viability=rec.viability)
    return out


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--model", help="the model field of requests (default: from /v1/models)")
    parser.add_argument("--requests", "-n", type=int, default=32, help="measured requests")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    parser.add_argument("--concurrency", "-c", type=int, help="closed loop clients (default 8)")
    parser.add_argument("--rate", type=float, help="open loop: arrivals per second (Poisson)")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of gaps (1: Poisson)"
    )
    parser.add_argument(
        "--mix", default="text=1", help="e.g. text=0.6,speech=0.2,image=0.2,walk:speak=1"
    )
    parser.add_argument("--prompt-len", default="16:64", help="text prompt tokens: N or LO:HI")
    parser.add_argument("--output-len", default="16:64", help="text max_tokens: N or LO:HI")
    parser.add_argument("--speech-len", default="8:32", help="speech input characters")
    parser.add_argument("--speech-tokens", default="16:32", help="speech max_tokens")
    parser.add_argument("--image-len", default="8:32", help="image prompt characters")
    parser.add_argument(
        "--token-range", default="3:259", help="prompt ids drawn from [LO, HI): the text vocab"
    )
    parser.add_argument(
        "--walk-inputs",
        action="append",
        default=[],
        metavar="WALK=JSON",
        help='inputs of walk requests, e.g. speak=\'{"prompt_ids": [[5, 6]], "max_new_tokens": 8}\'',
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", help="service targets, e.g. ttft=0.5,tpot=0.1,image=5")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--out", type=Path, help="write the summary and records as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> tuple[Workload, Arrivals, dict[str, float]]:
    lo, _, hi = args.token_range.partition(":")
    walk_inputs = []
    for item in args.walk_inputs:
        name, sep, inputs = item.partition("=")
        if not sep:
            raise ValueError(f"--walk-inputs {item!r}: write WALK=JSON")
        json.loads(inputs)  # a bad JSON fails here, not mid-run
        walk_inputs.append((name, inputs))
    workload = Workload(
        mix=Workload.parse_mix(args.mix),
        prompt_len=Lengths.parse(args.prompt_len),
        output_len=Lengths.parse(args.output_len),
        speech_len=Lengths.parse(args.speech_len),
        speech_tokens=Lengths.parse(args.speech_tokens),
        image_len=Lengths.parse(args.image_len),
        token_range=(int(lo), int(hi)),
        walk_inputs=tuple(walk_inputs),
        model=args.model,
        seed=args.seed,
    )
    concurrency = args.concurrency if args.concurrency is not None else 8
    if args.rate is not None and args.concurrency is None:
        concurrency = None
    arrivals = Arrivals(concurrency, args.rate, args.burstiness)
    return workload, arrivals, parse_slo(args.slo)


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable table of ``summarize``'s output."""

    def ms(s: dict[str, Any], key: str) -> str:
        v = s.get(key)
        return "-" if v is None else f"{1000 * v:.0f}"

    lines = [f"wall {summary['wall_s']:.2f} s"]
    head = f"{'kind':<8}{'ok/all':>9}{'req/s':>8}{'first p50/p99 ms':>20}{'e2e p50/p99 ms':>20}"
    lines.append(head + "  other")
    for kind, b in [("all", summary["overall"]), *summary["by_kind"].items()]:
        extra = []
        if "output_tokens_per_s" in b:
            extra.append(f"{b['output_tokens_per_s']:.1f} tok/s")
            if b["tpot_s"]["p50"] is not None:
                extra.append(f"tpot p50 {1000 * b['tpot_s']['p50']:.1f} ms")
        if "audio_seconds_per_s" in b:
            extra.append(f"{b['audio_seconds_per_s']:.2f} audio s/s")
            if b["rtf"]["p50"] is not None:
                extra.append(f"rtf p50 {b['rtf']['p50']:.2f}")
            if b["viable_share"] is not None:
                extra.append(f"viable {b['viable_share']:.2f}")
        if "goodput" in b:
            g = b["goodput"]
            extra.append(f"goodput {g['met']} ({g['requests_per_s']:.2f}/s)")
        if b["failures_by_status"]:
            extra.append(f"failures {b['failures_by_status']}")
        first, e2e = b["first_s"], b["e2e_s"]
        lines.append(
            f"{kind:<8}{b['succeeded']:>4}/{b['requests']:<4}{b['requests_per_s']:>8.2f}"
            f"{ms(first, 'p50'):>11}/{ms(first, 'p99'):<8}{ms(e2e, 'p50'):>11}/{ms(e2e, 'p99'):<8}"
            f"  {', '.join(extra)}"
        )
    return "\n".join(lines)


def served_model(url: str, api_key: str | None = None) -> str:
    """The id of the first model ``GET /v1/models`` lists (requests must name it)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot read the served model from {url}/v1/models: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="walkserve bench", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.model is None:
            args.model = served_model(args.url, args.api_key)
        workload, arrivals, slo = config_from_args(args)
        requests = plan(workload, args.requests, args.warmup)
    except ValueError as e:
        print(f"walkserve bench: error: {e}", file=sys.stderr)
        return 2
    records, wall = asyncio.run(
        run(args.url, requests, arrivals, args.seed, args.timeout, args.api_key, not args.quiet)
    )
    summary = summarize(records, wall, slo) if records else {"wall_s": wall}
    if records:
        print(format_summary(summary))
    if args.out:
        from walkserve.benchmarking import machine_info

        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "loadgen",
            "url": args.url,
            "mode": arrivals.mode,
            "arrivals": asdict(arrivals),
            "workload": asdict(workload),
            "summary": summary,
            "records": [record_dict(r) for r in records],
            **machine_info(),
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
