"""``POST /v1/audio/speech``: text in, WAV or raw PCM out; chunked as produced when
``stream``; ``voice`` picks one of the model's voices (``api.audio``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from walkserve.api import media
from walkserve.api.audio import AudioWatch
from walkserve.api.context import context, drain, stream_items, unless_gone
from walkserve.api.errors import ApiError, bad
from walkserve.api.schemas import SpeechRequest
from walkserve.api.sse import ClosingStream
from walkserve.runtime.server import RequestFailed

router = APIRouter()


@router.post("/v1/audio/speech")
async def speech(request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, SpeechRequest)
    ctx.check_model(body.model)
    task = ctx.profile.speech
    if task is None:
        raise bad(f"model {ctx.name!r} has no speech generation")
    ctx.need_output(task.walk, task.waveform_channel, "speech output")
    if body.speed != 1.0:
        raise bad(f"speed {body.speed} is not supported; send 1.0 or leave it out", "speed")
    if body.response_format not in ("wav", "pcm"):
        raise bad(
            f"response_format {body.response_format!r} is not supported: use 'wav' or 'pcm'",
            "response_format",
        )
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
    ticket, handle, t0 = await ctx.admit_and_submit(inputs, task.walk)
    as_wav = body.response_format == "wav"
    media_type = "audio/wav" if as_wav else "audio/pcm"
    metrics = ctx.metrics
    if not body.stream:
        try:
            on_item = ctx.first_observer("audio", task.waveform_channel, t0)
            try:
                outputs = await unless_gone(request, drain(handle, on_item))
            except RequestFailed as e:
                raise ApiError(500, f"the request failed: {e}", "server_error") from None
            waveform = outputs[task.waveform_channel]
            data = media.wav(waveform, task.sample_rate) if as_wav else media.pcm16(waveform)
            elapsed = time.perf_counter() - t0
            metrics.observe_latency(task.walk, elapsed)
            metrics.observe_real_time_factor(elapsed, waveform.shape[-1] / task.sample_rate)
            return Response(data, media_type=media_type)
        finally:
            ctx.cancel_all([handle], ticket)

    async def chunks() -> AsyncIterator[bytes]:
        if as_wav:
            yield media.wav_header(task.sample_rate, None)
        watch = AudioWatch(metrics, task.sample_rate, t0)
        async for item in stream_items(handle):
            if item.channel == task.waveform_channel:
                yield media.pcm16(watch.chunk(item.value))
        outputs = await ctx.finish(handle)
        rest = watch.rest(outputs.get(task.waveform_channel))
        if rest is not None:
            yield media.pcm16(watch.chunk(rest))
        watch.done()
        metrics.observe_latency(task.walk, time.perf_counter() - t0)

    return ClosingStream(chunks(), lambda: ctx.cancel_all([handle], ticket), media_type)
