"""Speech and chat-audio pieces of the HTTP API that need no server: the voice a request names
(``Voices`` of the model's profile), audio bytes in the requested format, and the OpenAI
chat-completion bodies that carry audio. Pure: no server, no I/O.

Chat with audio output, as the OpenAI API shapes it (``modalities: ["text", "audio"]``)::

    non-streamed   choices[0].message = {role, content: null,
                                         audio: {id, data: base64 audio, expires_at, transcript}}
    streamed       delta.audio = {id, transcript: "..."}    as text tokens stream
                   delta.audio = {id, data: base64 pcm16}   as waveform chunks stream
                   delta.audio = {id, expires_at}           last, with finish_reason

What crosses the boundary: ``Voices``/``Voice`` from ``api.profile``, waveform tensors
[B, samples] or [B, 1, samples] in [-1, 1], and JSON-ready dicts.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from walkserve.api import media
from walkserve.api.metrics import Metrics, PlaybackClock
from walkserve.api.profile import Voice, Voices
from walkserve.api.textgen import TextAssembler, reply_tokens

ChatAudioFormat = Literal["wav", "pcm16"]
CHAT_AUDIO_FORMATS: tuple[ChatAudioFormat, ...] = ("wav", "pcm16")
AUDIO_EXPIRES_S = 3600  # expires_at: nothing is kept for multi-turn use; a nominal hour


class Transcript:
    """A spoken reply's text, token by token: the lead outputs' tokens first (outputs that a
    walk sends before its stream, e.g. the prefill's token), then the streamed channel's; at
    the end, whatever the stream did not carry (a reply that ended before the stream began).
    ``text`` applies EOS and max_tokens; each call returns the text safe to send now."""

    def __init__(self, text: TextAssembler, leads: Sequence[str], channel: str) -> None:
        self.text, self.leads, self.channel = text, tuple(leads), channel
        self.fed = 0  # reply tokens taken so far (leads included)

    def stream(self, value: torch.Tensor, outputs: Mapping[str, Any]) -> str:
        """A streamed item of the channel; ``outputs``: the request's outputs so far."""
        tokens = [int(t) for t in value.reshape(-1).tolist()]
        if self.fed == 0:
            tokens = [int(outputs[n].reshape(-1)[0]) for n in self.leads if n in outputs] + tokens
        return self._feed(tokens)

    def finish(self, outputs: Mapping[str, Any]) -> str:
        """The request's final outputs: the tokens not streamed, then the held-back text."""
        tokens = list(reply_tokens(self.leads, self.channel, outputs))
        said = self._feed(tokens[self.fed :])
        self.text.finish()
        return said + self.text.take()

    def _feed(self, tokens: list[int]) -> str:
        self.fed += len(tokens)
        for token in tokens:
            if self.text.feed(token):
                break
        return self.text.take()


def voice_name(requested: str | dict[str, Any] | None) -> str | None:
    """The voice name of a request: a string, or OpenAI's ``{"id": name}`` object."""
    if requested is None or isinstance(requested, str):
        return requested
    name = requested.get("id")
    if not isinstance(name, str) or set(requested) != {"id"}:
        raise ValueError('voice must be a name or {"id": name}')
    return name


def resolve_voice(voices: Voices | None, requested: str | dict[str, Any] | None) -> Voice:
    """The voice to use. A model without a voice table has one voice: any name is accepted
    (OpenAI clients always send one) and changes nothing. ``ValueError`` names the model's
    voices when the requested one is not among them."""
    name = voice_name(requested)
    if voices is None:
        return Voice()
    return voices.resolve(name)


def chat_audio_format(value: str) -> ChatAudioFormat:
    return media.one_of(value, CHAT_AUDIO_FORMATS, "audio format")


def audio_bytes(waveform: torch.Tensor, fmt: ChatAudioFormat, sample_rate: int) -> bytes:
    """A whole waveform as WAV or raw 16-bit PCM."""
    return media.wav(waveform, sample_rate) if fmt == "wav" else media.pcm16(waveform)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def audio_id() -> str:
    return f"audio_{int(time.time() * 1000):x}"


def chat_audio_response(
    rid: str,
    model: str,
    created: int,
    audio_ref: str,
    data: bytes,
    transcript: str,
    finish_reason: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    """The non-streamed chat completion with audio output."""
    audio = {
        "id": audio_ref,
        "data": b64(data),
        "expires_at": int(time.time()) + AUDIO_EXPIRES_S,
        "transcript": transcript,
    }
    message = {"role": "assistant", "content": None, "audio": audio}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage,
    }


def audio_chunk(
    rid: str,
    model: str,
    audio: dict[str, Any] | None,
    finish_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: ``delta.audio`` (an id with data, transcript or expires_at), the
    assistant role on the first chunk, ``finish_reason`` on the last."""
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if audio is not None:
        delta["audio"] = audio
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


class AudioWatch:
    """Observes one streamed audio response: time to first audio, playback viability (see
    ``api.metrics``) and the real-time factor, chunk by chunk."""

    def __init__(self, metrics: Metrics, sample_rate: int, t0: float) -> None:
        self.metrics, self.sample_rate, self.t0 = metrics, sample_rate, t0
        self.clock = PlaybackClock()
        self.samples = 0

    def chunk(self, waveform: torch.Tensor) -> torch.Tensor:  # [..., samples]
        now = time.perf_counter()
        if self.clock.start is None:
            self.metrics.observe_first("audio", now - self.t0)
        self.clock.arrive(now, waveform.shape[-1] / self.sample_rate)
        self.samples += waveform.shape[-1]
        return waveform

    def rest(self, waveform: torch.Tensor | None) -> torch.Tensor | None:
        """The part of the final waveform output not streamed yet (all of it when the walk's
        waveform is a plain output, not a streamed channel); None if nothing is left."""
        if waveform is None or waveform.shape[-1] <= self.samples:
            return None
        return waveform[..., self.samples :]

    def done(self) -> None:
        self.metrics.observe_playback(self.clock)
        elapsed = time.perf_counter() - self.t0
        self.metrics.observe_real_time_factor(elapsed, self.samples / self.sample_rate)
