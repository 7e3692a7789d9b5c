"""``POST /v1/audio/transcriptions``: multipart, as the ``openai`` client sends it (the audio as
file part ``file``, the other fields as text parts), for models whose profile has a
``TranscriptionTask`` (a thinker that reads audio); 404 for the others.

    file      decoded by PyAV (``api.audiocodec``), mono, resampled to the extractor's rate
    features  the model's own feature extractor (``task.features``) -> features and frame mask
    prompt    ``task.prompt(frames, language, prompt)``: the clip's placeholders and the
              instruction, where ``language`` and ``prompt`` go
    decode    the walk, greedy; the reply's tokens decoded as the profile's text task does

``response_format`` json (``{text, usage}``), text (plain text) or verbose_json (``{task,
language, duration, text, usage}``, no segments: none are computed); ``stream`` true sends
OpenAI's ``transcript.text.delta`` events as tokens come, then one ``transcript.text.done``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from walkserve.api import audiocodec
from walkserve.api.audio import Transcript
from walkserve.api.context import context, stream_items, unless_gone, validate
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.form import parse_form
from walkserve.api.profile import TranscriptionTask
from walkserve.api.schemas import TranscriptionRequest
from walkserve.api.sse import ClosingStream, sse
from walkserve.api.textgen import TextAssembler

router = APIRouter()
RESPONSE_FORMATS = ("json", "text", "verbose_json")


def clip_inputs(
    task: TranscriptionTask, data: bytes, language: str | None, context_text: str | None
) -> tuple[dict[str, Any], list[int], float]:
    """The walk inputs of one uploaded clip (raises ``ValueError`` for a bad file), the prompt
    ids and the clip's duration in seconds. CPU work: run off the event loop."""
    waveform = audiocodec.decode(data, task.sample_rate, task.max_audio_seconds)  # [n]
    features, mask = task.features(waveform)  # [1, mel, T], [1, T]
    ids = task.prompt(int(mask.sum()), language, context_text)
    inputs = {
        task.prompt_input: torch.tensor([ids], dtype=torch.int64),
        task.features_input: features,
        task.mask_input: mask,
        task.max_tokens_input: task.max_tokens,
        **task.extra_inputs,
    }
    return inputs, ids, waveform.shape[0] / task.sample_rate


def usage(ids: list[int], text: TextAssembler) -> dict[str, Any]:
    out = len(text.tokens)
    return {
        "type": "tokens",
        "input_tokens": len(ids),
        "output_tokens": out,
        "total_tokens": len(ids) + out,
    }


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    ctx = context(request)
    task, text_task = ctx.profile.transcription, ctx.profile.text
    if task is None or text_task is None:
        raise ApiError(
            404,
            f"model {ctx.name!r} takes no audio input, so /v1/audio/transcriptions is not served",
            "not_found_error",
        )
    try:
        form = parse_form(await ctx.read_body(request), request.headers.get("content-type", ""))
    except ValueError as e:
        raise bad(str(e)) from None
    upload = form.files.get("file")
    if upload is None:
        raise bad(
            f"send the audio as the multipart file field 'file' ({audiocodec.UPLOAD_ACCEPTED})",
            "file",
        )
    body = validate(dict(form.fields), TranscriptionRequest, strict=False)
    ctx.check_model(body.model)
    if body.response_format not in RESPONSE_FORMATS:
        raise bad(
            f"response_format {body.response_format!r} is not supported: use one of"
            f" {list(RESPONSE_FORMATS)}",
            "response_format",
        )
    if body.temperature != 0.0:
        raise bad(
            f"temperature {body.temperature} is not supported: transcription decodes greedily;"
            " send 0 or leave it out",
            "temperature",
        )
    try:
        inputs, ids, duration = await run_in_threadpool(
            clip_inputs, task, upload.data, body.language, body.prompt
        )
    except ValueError as e:
        raise bad(str(e), "file") from None
    ctx.check_ids(ids, text_task.vocab_size, text_task.max_prompt_tokens, "prompt (with the audio)")
    ticket, handle, t0 = await ctx.admit_and_submit(inputs, task.walk, stream=body.stream)
    text = TextAssembler(text_task, [], task.max_tokens)
    said = Transcript(text, task.leads, task.text_channel)
    if not body.stream:
        try:
            outputs = await unless_gone(request, ctx.finish(handle))
        finally:
            ctx.cancel_all([handle], ticket)
        said.finish(outputs)
        ctx.metrics.observe_latency(task.walk, time.perf_counter() - t0)
        return answer(body, text, ids, duration)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for item in stream_items(handle):
                if item.channel == task.text_channel and (
                    piece := said.stream(item.value, handle.outputs())
                ):
                    yield sse({"type": "transcript.text.delta", "delta": piece})
            outputs = await ctx.finish(handle)
        except ApiError as e:
            yield sse({"type": "error", **error_body(e.message, e.kind)})
            return
        if tail := said.finish(outputs):
            yield sse({"type": "transcript.text.delta", "delta": tail})
        ctx.metrics.observe_latency(task.walk, time.perf_counter() - t0)
        done = {"type": "transcript.text.done", "text": text.text, "usage": usage(ids, text)}
        yield sse(done)

    return ClosingStream(events(), lambda: ctx.cancel_all([handle], ticket), "text/event-stream")


def answer(
    body: TranscriptionRequest, text: TextAssembler, ids: list[int], duration: float
) -> Response:
    if body.response_format == "text":
        return PlainTextResponse(text.text)
    if body.response_format == "verbose_json":
        return JSONResponse(
            {
                "task": "transcribe",
                "language": body.language or "unknown",
                "duration": duration,
                "text": text.text,
                "usage": {"type": "duration", "seconds": duration},
            }
        )
    return JSONResponse({"text": text.text, "usage": usage(ids, text)})
