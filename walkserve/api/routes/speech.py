"""``POST /v1/audio/speech``: text in, audio out in the requested ``response_format`` (mp3,
opus, aac, flac, wav, pcm: ``api.audiocodec``); ``voice`` picks one of the model's voices
(``api.audio``). Three ways to answer:

    whole        stream false, stream_format absent or "audio": one file
    raw chunks   stream true: the file's bytes as the encoder writes them, the encoder fed each
                 waveform item as the walk streams it
    SSE          stream_format "sse" (OpenAI's): ``speech.audio.delta`` events, each with
                 base64 bytes of the same stream, then one ``speech.audio.done`` with usage

``speed`` (0.25 to 4) other than 1 time-stretches the audio at the same pitch (FFmpeg's
``atempo``, ``audiocodec.Tempo``), streamed chunk by chunk as well."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from walkserve.api import audiocodec
from walkserve.api.audio import AudioWatch, b64
from walkserve.api.context import context, drain, stream_items, unless_gone
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.schemas import SpeechRequest
from walkserve.api.sse import ClosingStream, sse
from walkserve.runtime.server import RequestFailed

router = APIRouter()


def whole_file(
    waveform: torch.Tensor, fmt: audiocodec.SpeechFormat, speed: float, sample_rate: int
) -> bytes:
    """A whole answer: the waveform, time-stretched when ``speed`` is not 1, as one file."""
    if speed != 1.0:
        tempo = audiocodec.Tempo(speed, sample_rate)
        waveform = torch.cat([tempo.feed(waveform), tempo.close()])
    return audiocodec.encode(waveform, fmt, sample_rate)


@router.post("/v1/audio/speech")
async def speech(request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, SpeechRequest)
    ctx.check_model(body.model)
    task = ctx.profile.speech
    if task is None:
        raise bad(f"model {ctx.name!r} has no speech generation")
    ctx.need_output(task.walk, task.waveform_channel, "speech output")
    try:
        fmt = audiocodec.speech_format(body.response_format)
    except ValueError as e:
        raise bad(str(e), "response_format") from None
    voice = ctx.pick_voice(task.voices, body.voice)
    ids = task.encode(voice.prefix + body.input)
    ctx.check_ids(ids, task.vocab_size, task.max_prompt_tokens, "input")
    max_tokens = ctx.check_max_tokens(
        body.max_tokens, task.default_max_tokens, task.max_tokens_limit
    )
    inputs = {
        task.prompt_input: torch.tensor([ids], dtype=torch.int64),
        task.max_tokens_input: max_tokens,
        **task.extra_inputs,
        **voice.inputs,
        **ctx.walk_sampling(task.walk),
    }
    as_sse = body.stream_format == "sse"
    ticket, handle, t0 = await ctx.admit_and_submit(inputs, task.walk)
    media_type = audiocodec.MEDIA_TYPES[fmt]
    metrics = ctx.metrics
    if not body.stream and not as_sse:
        try:
            on_item = ctx.first_observer("audio", task.waveform_channel, t0)
            try:
                outputs = await unless_gone(request, drain(handle, on_item))
            except RequestFailed as e:
                raise ApiError(500, f"the request failed: {e}", "server_error") from None
            waveform = outputs[task.waveform_channel]
            data = await run_in_threadpool(whole_file, waveform, fmt, body.speed, task.sample_rate)
            elapsed = time.perf_counter() - t0
            metrics.observe_latency(task.walk, elapsed)
            metrics.observe_real_time_factor(elapsed, waveform.shape[-1] / task.sample_rate)
            return Response(data, media_type=media_type)
        finally:
            ctx.cancel_all([handle], ticket)

    def usage() -> dict[str, Any]:
        # output_tokens: the walk's audio tokens are not an output the profile names
        return {"input_tokens": len(ids), "output_tokens": 0, "total_tokens": len(ids)}

    async def chunks() -> AsyncIterator[bytes]:
        encoder = audiocodec.AudioEncoder(fmt, task.sample_rate, streamed=True)
        tempo = None if body.speed == 1.0 else audiocodec.Tempo(body.speed, task.sample_rate)

        def encode(waveform: torch.Tensor) -> bytes:
            return encoder.feed(waveform if tempo is None else tempo.feed(waveform))

        def finish() -> bytes:
            return (b"" if tempo is None else encoder.feed(tempo.close())) + encoder.close()

        watch = AudioWatch(metrics, task.sample_rate, t0)
        # The codecs run on the pool's threads (PyAV releases the GIL), not on the loop.
        async for item in stream_items(handle):
            if item.channel == task.waveform_channel and (
                data := await run_in_threadpool(encode, watch.chunk(item.value))
            ):
                yield data
        outputs = await ctx.finish(handle)
        rest = watch.rest(outputs.get(task.waveform_channel))
        if rest is not None and (data := await run_in_threadpool(encode, watch.chunk(rest))):
            yield data
        if data := await run_in_threadpool(finish):
            yield data
        watch.done()
        metrics.observe_latency(task.walk, time.perf_counter() - t0)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for data in chunks():
                yield sse({"type": "speech.audio.delta", "audio": b64(data)})
        except ApiError as e:
            yield sse({"type": "error", **error_body(e.message, e.kind)})
            return
        yield sse({"type": "speech.audio.done", "usage": usage()})

    content, kind = (events(), "text/event-stream") if as_sse else (chunks(), media_type)
    return ClosingStream(content, lambda: ctx.cancel_all([handle], ticket), kind)
