"""Compressed audio for the HTTP API, through PyAV (FFmpeg's encoders, decoders and muxers, as
its wheels bundle them): speech out as mp3, opus (Ogg), aac (ADTS) or flac, encoded as the
waveform arrives, and uploaded clips in (wav, mp3, flac, ogg, m4a, webm) decoded to mono float
samples at the rate a model's feature extractor wants. WAV and raw PCM need no codec
(``api.media``) and are written here through the same encoder interface.

Encoding, streamed or whole::

    enc = AudioEncoder(fmt, sample_rate, streamed=True)
    for chunk in waveform_chunks:         # [..., samples] float in [-1, 1]
        send(enc.feed(chunk))              # the bytes the muxer has written so far (maybe none)
    send(enc.close())                      # the encoder's tail and the container's trailer

A streamed encoder writes to a sink that cannot seek, so nothing is written back into a header:
an mp3 stream then carries no LAME delay tag (a decoder plays the encoder's delay, 1105
samples, as leading silence) and a FLAC stream's STREAMINFO leaves the total length open. A
whole response (``streamed=False``) is written to a seekable buffer, so mp3 and FLAC decode to
exactly the samples given; Ogg Opus always does (its pre-skip and end granule are in the
stream). AAC in ADTS cannot say how much priming it has: it decodes to ``AAC_PRIMING`` more
samples first, and every codec pads the end to its frame size.

What crosses the boundary: waveform tensors in, bytes out; bytes in, a float32 tensor
[samples] out. Bad input raises ``ValueError`` with a message for the client.
"""

from __future__ import annotations

import io
import itertools
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import torch

from walkserve.api import media

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
SPEECH_FORMATS: tuple[SpeechFormat, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES: dict[SpeechFormat, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
# format -> (muxer, encoder)
CODECS: dict[str, tuple[str, str]] = {
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "flac": ("flac", "flac"),
}
AAC_PRIMING = 1024  # samples FFmpeg's AAC encoder puts first; ADTS cannot signal them
MP3_DELAY = 1105  # LAME's encoder delay, played as silence when no LAME tag says it
OGG_PAGE_US = 20000  # flush an Ogg page every 20 ms of audio, so opus streams as it comes
# Demuxers accepted for uploads (FFmpeg names): common audio files, not every format FFmpeg reads.
UPLOAD_CONTAINERS = frozenset(
    {"wav", "mp3", "flac", "ogg", "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "aac"}
)
UPLOAD_ACCEPTED = "wav, mp3, flac, ogg (opus, vorbis), m4a or webm audio"


def speech_format(value: str) -> SpeechFormat:
    return media.one_of(value, SPEECH_FORMATS, "response_format")


class _Sink:
    """A write-only, unseekable file for the muxer: what it wrote since the last ``take``."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def _codec_rate(codec: str, rate: int) -> int:
    """``rate`` if the encoder takes it, else the nearest higher rate it takes (or its highest);
    PyAV resamples the frames fed to it."""
    import av

    rates = av.Codec(codec, "w").audio_rates
    if not rates or rate in rates:
        return rate
    higher = [r for r in rates if r > rate]
    return min(higher) if higher else max(rates)


class AudioEncoder:
    """Mono 16-bit audio in ``fmt``, fed incrementally (see the module docstring)."""

    def __init__(self, fmt: SpeechFormat, sample_rate: int, streamed: bool = True) -> None:
        self.fmt, self.sample_rate, self.streamed = fmt, sample_rate, streamed
        self.samples = 0
        self._pcm: list[bytes] = []  # a whole wav: its header needs the length
        self._started = False
        if fmt in ("wav", "pcm"):
            return
        import av

        muxer, codec = CODECS[fmt]
        self._out: _Sink | io.BytesIO = _Sink() if streamed else io.BytesIO()
        options = {"page_duration": str(OGG_PAGE_US)} if muxer == "ogg" else {}
        self._container: Any = av.open(self._out, "w", format=muxer, options=options)
        self._stream: Any = self._container.add_stream(
            codec, rate=_codec_rate(codec, sample_rate), layout="mono"
        )
        self._stream.codec_context.open()  # now: its frame size is known before the first feed

    @property
    def frame_size(self) -> int:
        """Samples per codec frame (1 for wav and pcm)."""
        if self.fmt in ("wav", "pcm"):
            return 1
        return int(self._stream.codec_context.frame_size) or 1

    def feed(self, waveform: torch.Tensor) -> bytes:  # waveform: [..., samples]
        pcm = media.pcm16(waveform)
        self.samples += len(pcm) // 2
        if self.fmt in ("wav", "pcm"):
            if not self.streamed:
                self._pcm.append(pcm)
                return b""
            head = b""
            if self.fmt == "wav" and not self._started:
                head = media.wav_header(self.sample_rate, None)
            self._started = True
            return head + pcm
        if not pcm:
            return b""
        import av

        samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._take()

    def close(self) -> bytes:
        """The rest of the stream (the whole file when not streamed)."""
        if self.fmt in ("wav", "pcm"):
            if self.streamed:
                return media.wav_header(self.sample_rate, None) if not self._started else b""
            data = b"".join(self._pcm)
            return (
                media.wav_header(self.sample_rate, len(data)) + data if self.fmt == "wav" else data
            )
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        if isinstance(self._out, io.BytesIO):
            return self._out.getvalue()
        return self._out.take()

    def _take(self) -> bytes:
        return self._out.take() if isinstance(self._out, _Sink) else b""


class Tempo:
    """Audio played ``speed`` times faster at the same pitch: FFmpeg's ``atempo`` filter (a
    WSOLA time-stretch), fed chunk by chunk; what it returns so far is [samples] float32, the
    same samples however the input is chunked. The stretched length is the input's / ``speed``
    within atempo's window (60 ms) per chained filter (two below speed 0.5)."""

    MIN_FACTOR = 0.5  # atempo's least factor; slower speeds chain two filters
    WINDOW_S = 0.06  # atempo's default window

    def __init__(self, speed: float, sample_rate: int) -> None:
        import av.filter

        factors = []
        while speed < self.MIN_FACTOR:
            factors.append(self.MIN_FACTOR)
            speed /= self.MIN_FACTOR
        factors.append(speed)
        self.sample_rate, self.pts = sample_rate, 0
        self.graph: Any = av.filter.Graph()
        nodes = [
            self.graph.add_abuffer(
                format="flt",
                sample_rate=sample_rate,
                layout="mono",
                time_base=Fraction(1, sample_rate),
            ),
            *[self.graph.add("atempo", f"{f:.6f}") for f in factors],
            self.graph.add("abuffersink"),
        ]
        for a, b in itertools.pairwise(nodes):
            a.link_to(b)
        self.graph.configure()

    def feed(self, waveform: torch.Tensor) -> torch.Tensor:  # [..., samples] -> [samples']
        import av

        samples = waveform.detach().float().reshape(1, -1).clamp(-1.0, 1.0).numpy()
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate, frame.time_base = self.sample_rate, Fraction(1, self.sample_rate)
        frame.pts, self.pts = self.pts, self.pts + samples.shape[1]
        self.graph.push(frame)
        return self._pull()

    def close(self) -> torch.Tensor:
        self.graph.push(None)
        return self._pull()

    def _pull(self) -> torch.Tensor:
        import av

        parts = [np.zeros(0, np.float32)]
        while True:
            try:
                parts.append(self.graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                return torch.from_numpy(np.concatenate(parts))


def leading_samples(fmt: SpeechFormat, streamed: bool) -> int:
    """Samples a decoder plays before the first one encoded, because the stream cannot say
    how many to skip (see the module docstring); a client that wants the exact audio drops
    them. The end is padded to the codec frame, and a streamed mp3 also holds LAME's flush of
    up to one more frame."""
    if fmt == "aac":
        return AAC_PRIMING
    if fmt == "mp3" and streamed:
        return MP3_DELAY
    return 0


def encode(waveform: torch.Tensor, fmt: SpeechFormat, sample_rate: int) -> bytes:
    """A whole waveform [..., samples] as one file of ``fmt``."""
    enc = AudioEncoder(fmt, sample_rate, streamed=False)
    enc.feed(waveform)
    return enc.close()


def open_upload(data: bytes, containers: frozenset[str], kind: str, accepted: str) -> Any:
    """PyAV's container of an uploaded file whose demuxer is one of ``containers`` (FFmpeg's
    names); ``ValueError`` naming ``accepted`` otherwise. ``kind``: "audio" or "video"."""
    import av

    try:
        container = av.open(io.BytesIO(data), "r")
    except av.FFmpegError as e:
        what = "audio" if kind == "audio" else f"a {kind}"
        raise ValueError(
            f"the file is not {what} that can be read ({e}); send {accepted}"
        ) from None
    if container.format.name not in containers:
        container.close()
        raise ValueError(
            f"{kind} in a {container.format.name!r} container is not accepted; send {accepted}"
        )
    return container


def decode(data: bytes, sample_rate: int, max_seconds: float) -> torch.Tensor:
    """An uploaded audio file -> its first audio stream, mixed to mono and resampled to
    ``sample_rate``, as float32 samples [n] in [-1, 1]. ``ValueError`` for a file that is not
    audio of an accepted container, has no audio, or is longer than ``max_seconds``."""
    import av

    if not data:
        raise ValueError(f"the audio file is empty; send {UPLOAD_ACCEPTED}")
    limit = int(max_seconds * sample_rate)
    container = open_upload(data, UPLOAD_CONTAINERS, "audio", UPLOAD_ACCEPTED)
    try:
        if not container.streams.audio:
            raise ValueError(f"the file has no audio stream; send {UPLOAD_ACCEPTED}")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
        parts: list[np.ndarray] = []
        total = 0

        def take(frames: list[Any]) -> None:
            nonlocal total
            for f in frames:
                parts.append(f.to_ndarray().reshape(-1))
                total += f.samples
            if total > limit:
                raise ValueError(
                    f"the audio is longer than the limit of {max_seconds:g} s for this model"
                )

        for frame in container.decode(audio=0):
            take(resampler.resample(frame))
        take(resampler.resample(None))
    except av.FFmpegError as e:
        raise ValueError(f"the audio cannot be decoded ({e}); send {UPLOAD_ACCEPTED}") from None
    finally:
        container.close()
    if total == 0:
        raise ValueError("the audio file holds no samples")
    return torch.from_numpy(np.concatenate(parts).astype(np.float32))
