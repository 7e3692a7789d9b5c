"""``POST /v1/chat/completions``: the messages through the model's chat template, then the
text generation of ``routes.text``; with ``modalities: ["text", "audio"]`` one request of the
profile's chat-audio walk, whose text tokens are the transcript and whose waveform the audio
(``api.audio``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from walkserve.api import audio, media
from walkserve.api.audio import AudioWatch
from walkserve.api.context import ApiContext, context, drain, stream_items, unless_gone
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.profile import ChatAudioTask, TextTask
from walkserve.api.routes.text import run_text, sampling_inputs, text_task
from walkserve.api.schemas import ChatCompletionRequest
from walkserve.api.sse import SSE_DONE, ClosingStream, sse
from walkserve.api.textgen import TextAssembler, chunk, usage
from walkserve.runtime.conductor import StreamItem
from walkserve.runtime.server import RequestFailed

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, ChatCompletionRequest)
    ctx.check_model(body.model)
    if "audio" in (body.modalities or []):
        return await run_chat_audio(ctx, request, body)
    if body.audio is not None:
        raise bad('audio is set but modalities has no "audio": send ["text", "audio"]', "audio")
    task = text_task(ctx)
    choices = sampling_inputs(task, body)
    prompt = task.chat_template([(m.role, m.content) for m in body.messages])
    ids = task.encode(prompt)
    ctx.check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt (after the chat template)")
    return await run_text(ctx, request, task, ids, body, choices, chat=True)


def chat_audio_task(ctx: ApiContext) -> tuple[ChatAudioTask, TextTask]:
    task = ctx.profile.chat_audio
    if task is None or ctx.profile.text is None:
        raise bad(
            f'model {ctx.name!r} has no audio output: send modalities ["text"] (or leave'
            " modalities out)",
            "modalities",
        )
    ctx.need_output(task.walk, task.waveform_channel, "audio output")
    return task, ctx.profile.text


async def run_chat_audio(
    ctx: ApiContext, request: Request, body: ChatCompletionRequest
) -> Response:
    """``modalities: ["text", "audio"]``: one request of the task's walk; the reply's text
    tokens are the transcript, its waveform the audio (see ``api.audio``)."""
    task, text_task_ = chat_audio_task(ctx)
    params = body.audio
    if params is None:
        raise bad('modalities has "audio": send audio: {"voice": ..., "format": "wav"}', "audio")
    try:
        fmt = audio.chat_audio_format(params.format)
    except ValueError as e:
        raise bad(str(e), "audio.format") from None
    if body.n != 1:
        raise bad(f"n={body.n} is not supported with audio output: send n=1", "n")
    if body.stop:
        raise bad("stop is not supported with audio output (the audio would not stop)", "stop")
    voice = ctx.pick_voice(task.voices, params.voice)
    prompt = text_task_.chat_template([(m.role, m.content) for m in body.messages])
    ids = text_task_.encode(prompt)
    ctx.check_ids(
        ids, text_task_.vocab_size, text_task_.max_prompt_tokens, "prompt (after the chat template)"
    )
    limit = body.max_completion_tokens or body.max_tokens
    max_tokens = ctx.check_max_tokens(
        limit, text_task_.default_max_tokens, text_task_.max_tokens_limit
    )
    inputs = {
        task.prompt_input: torch.tensor([ids], dtype=torch.int64),
        task.max_tokens_input: max_tokens,
        **task.extra_inputs,
        **voice.inputs,
        **ctx.walk_sampling(task.walk, body.temperature, body.top_p, body.top_k, body.seed),
    }
    ticket, handle, t0 = await ctx.admit_and_submit(inputs, task.walk)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    name = ctx.name
    metrics = ctx.metrics
    audio_ref = audio.audio_id()
    text = TextAssembler(text_task_, [], max_tokens)
    if not body.stream:
        try:
            on_audio = ctx.first_observer("audio", task.waveform_channel, t0)
            on_token = ctx.first_observer("token", task.transcript_channel, t0)

            def on_item(item: StreamItem) -> None:
                on_audio(item)
                on_token(item)

            try:
                outputs = await unless_gone(request, drain(handle, on_item))
            except RequestFailed as e:
                raise ApiError(500, f"the request failed: {e}", "server_error") from None
        finally:
            ctx.cancel_all([handle], ticket)
        audio.Transcript(text, task.leads, task.transcript_channel).finish(outputs)
        waveform = outputs[task.waveform_channel]
        elapsed = time.perf_counter() - t0
        metrics.observe_latency(task.walk, elapsed)
        metrics.observe_real_time_factor(elapsed, waveform.shape[-1] / task.sample_rate)
        data = audio.audio_bytes(waveform, fmt, task.sample_rate)
        return JSONResponse(
            audio.chat_audio_response(
                rid,
                name,
                ctx.created,
                audio_ref,
                data,
                text.text,
                text.finish_reason,
                usage(ids, [text]),
            )
        )

    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def piece(**fields: Any) -> bytes:
        return sse(audio.audio_chunk(rid, name, {"id": audio_ref, **fields}))

    async def events() -> AsyncIterator[bytes]:
        yield sse(audio.audio_chunk(rid, name, None, role=True))
        watch = AudioWatch(metrics, task.sample_rate, t0)
        observe = ctx.first_observer("token", task.transcript_channel, t0)
        header = fmt == "wav"  # a streamed WAV: the header (sizes open) leads the data
        said = audio.Transcript(text, task.leads, task.transcript_channel)
        try:
            async for item in stream_items(handle):
                if item.channel == task.transcript_channel:
                    observe(item)
                    if piece_text := said.stream(item.value, handle.outputs()):
                        yield piece(transcript=piece_text)
                elif item.channel == task.waveform_channel:
                    data = media.pcm16(watch.chunk(item.value))
                    if header:
                        data, header = media.wav_header(task.sample_rate, None) + data, False
                    yield piece(data=audio.b64(data))
            outputs = await ctx.finish(handle)
        except ApiError as e:
            yield sse(error_body(e.message, e.kind))
            yield SSE_DONE
            return
        if tail := said.finish(outputs):
            yield piece(transcript=tail)
        rest = watch.rest(outputs.get(task.waveform_channel))
        if rest is not None:
            data = media.pcm16(watch.chunk(rest))
            if header:
                data = media.wav_header(task.sample_rate, None) + data
            yield piece(data=audio.b64(data))
        watch.done()
        expires = int(time.time()) + audio.AUDIO_EXPIRES_S
        yield sse(
            audio.audio_chunk(
                rid, name, {"id": audio_ref, "expires_at": expires}, text.finish_reason
            )
        )
        if include_usage:
            yield sse({**chunk(rid, name, True, None), "choices": [], "usage": usage(ids, [text])})
        metrics.observe_latency(task.walk, time.perf_counter() - t0)
        yield SSE_DONE

    return ClosingStream(events(), lambda: ctx.cancel_all([handle], ticket), "text/event-stream")
