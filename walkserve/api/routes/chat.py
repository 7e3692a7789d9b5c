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
from starlette.concurrency import run_in_threadpool

from walkserve.api import audio, chatmedia, chatprompt, media, tools
from walkserve.api.audio import AudioWatch
from walkserve.api.context import ApiContext, context, drain, stream_items, unless_gone
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.profile import ChatAudioTask, TextTask
from walkserve.api.routes.text import Step, plan_text, request_grammar, run_text, text_task
from walkserve.api.schemas import ChatCompletionRequest
from walkserve.api.sse import SSE_DONE, ClosingStream, sse
from walkserve.api.textgen import Choice, TextAssembler, chat_logprobs, envelope, usage
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
    if not task.has_tokenizer:
        raise bad(
            "this server has no tokenizer (--skip-tokenizer-init, or the checkpoint has none),"
            " so it cannot apply a chat template: use /v1/completions with token ids",
            "messages",
        )
    if body.top_logprobs and not body.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    mode, grammar = tool_mode(ctx, task, body)
    task, ids = await chat_prompt(ctx, task, body)
    ctx.check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt (after the chat template)")
    columns = 1 + (body.top_logprobs or 0) if body.logprobs else 0
    plan = plan_text(ctx, task, body, ids, columns, grammar)
    return await run_text(ctx, request, task, plan, body, ChatShape(task, body, mode))


async def chat_prompt(
    ctx: ApiContext, task: TextTask, body: ChatCompletionRequest
) -> tuple[TextTask, list[int]]:
    """The prompt ids of the messages, and the task that runs them: ``task`` itself, or with
    media parts the profile's media walk with the media inputs (``api.chatmedia``)."""
    if ctx.profile.chat_media is None:
        return task, task.encode(chatprompt.render(task, body.messages, body.tools, ctx.name))
    parts = chatmedia.MediaParts(
        ctx.profile.chat_media, ctx.name, ctx.config.max_image_pixels, fetch=ctx.config.media
    )
    prompt = chatprompt.render(task, body.messages, body.tools, ctx.name, parts.mark)
    if not parts.parts:
        return task, task.encode(prompt)
    walk, inputs, ids = await run_in_threadpool(parts.prompt, prompt, task.encode)
    return chatmedia.media_text_task(task, walk, inputs), ids


ToolMode = str  # "none" (no parsing), "auto", "forced"


def tool_mode(
    ctx: ApiContext, task: TextTask, body: ChatCompletionRequest
) -> tuple[ToolMode, str | None]:
    """How the reply is read for tool calls, and the grammar of the request (a forced call's
    or the response format's)."""
    grammar = request_grammar(body)
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return "none", grammar
    choice = body.tool_choice or "auto"
    if choice == "none":
        return "none", grammar
    if choice == "auto":
        return "auto", grammar
    if grammar is not None:
        raise bad(
            "a forced tool call and a response format cannot both constrain the reply",
            "tool_choice",
        )
    functions = [(t.function.name, t.function.parameters) for t in body.tools]
    if not isinstance(choice, str):
        functions = [f for f in functions if f[0] == choice.function.name]
        if not functions:
            raise bad(
                f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
    if not task.structured_output:
        raise bad(
            f"model {ctx.name!r} cannot force a tool call (no grammar vocabulary)", "tool_choice"
        )
    try:
        return "forced", tools.call_grammar(functions, task.tool_format)
    except ValueError as e:
        raise bad(str(e), "tools") from None


class ChatShape:
    """The chat API's bodies: ``choices[i].message`` (content, tool calls) and its logprobs;
    streamed as ``delta`` chunks (content as it comes; a tool call once complete)."""

    chat = True

    def __init__(self, task: TextTask, body: ChatCompletionRequest, mode: ToolMode) -> None:
        self.task, self.body, self.mode = task, body, mode
        self.top = body.top_logprobs or 0
        self.parsers: dict[int, tools.StreamParser] = {}
        self.calls_sent: dict[int, int] = {}

    def _calls(self, calls: list[tools.Call]) -> list[tools.Call]:
        return calls[:1] if self.body.parallel_tool_calls is False else calls

    def choice(self, index: int, c: Choice, echo: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text.text}
        finish = c.text.finish_reason
        if self.mode != "none":
            content, calls = tools.parse_calls(c.text.text, self.task.tool_format)
            calls = self._calls(calls)
            if calls:
                message = {"role": "assistant", "content": content}
                message["tool_calls"] = [call.as_json() for call in calls]
                finish = "tool_calls"
        out: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish}
        out["logprobs"] = chat_logprobs(self.task, c.kept, self.top) if self.body.logprobs else None
        if self.body.return_token_ids:
            out["token_ids"] = list(c.text.tokens)
        return out

    def start(self, index: int, echo: str) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]

    def delta(
        self, index: int, c: Choice, text: str, steps: list[Step], final: bool
    ) -> list[dict[str, Any]]:
        delta: dict[str, Any] = {}
        if self.mode == "none":
            delta["content"] = text
        else:
            parser = self.parsers.setdefault(index, tools.StreamParser(self.task.tool_format))
            content, calls = parser.feed(text, final)
            if content:
                delta["content"] = content
            sent = self.calls_sent.get(index, 0)
            calls = self._calls(calls)[
                : (1 - sent) if self.body.parallel_tool_calls is False else None
            ]
            if calls:
                delta["tool_calls"] = [call.as_json(sent + k) for k, call in enumerate(calls)]
                self.calls_sent[index] = sent + len(calls)
        if not delta and not (steps and self.body.logprobs) and not final:
            return []
        out: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None}
        if final:
            out["finish_reason"] = (
                "tool_calls" if self.calls_sent.get(index) else c.text.finish_reason
            )
        out["logprobs"] = (
            chat_logprobs(self.task, steps, self.top) if self.body.logprobs and steps else None
        )
        if self.body.return_token_ids:
            out["token_ids"] = [s.token for s in steps]
        return [out]


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
    unsupported = (
        [
            name
            for name in (
                "logprobs",
                "top_logprobs",
                "tools",
                "tool_choice",
                "response_format",
                "guided_json",
                "guided_regex",
                "guided_choice",
                "logit_bias",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "min_tokens",
                "parallel_tool_calls",
            )
            if getattr(body, name) not in (None, False)
        ]
        + (["ignore_eos"] if body.ignore_eos else [])
        + (["return_token_ids"] if body.return_token_ids else [])
    )
    if unsupported:
        raise bad(f"{unsupported[0]} is not supported with audio output", unsupported[0])
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
    walk = task.walk
    media_inputs: dict[str, Any] = {}
    if ctx.profile.chat_media is None:
        ids = text_task_.encode(chatprompt.render(text_task_, body.messages, None, ctx.name))
    else:
        parts = chatmedia.MediaParts(
            ctx.profile.chat_media,
            ctx.name,
            ctx.config.max_image_pixels,
            speaking=True,
            fetch=ctx.config.media,
        )
        prompt = chatprompt.render(text_task_, body.messages, None, ctx.name, parts.mark)
        if parts.parts:
            walk, media_inputs, ids = await run_in_threadpool(
                parts.prompt, prompt, text_task_.encode
            )
        else:
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
        **ctx.walk_sampling(walk, body.temperature, body.top_p, body.top_k, body.seed),
        **media_inputs,
    }
    ticket, handle, t0 = await ctx.admit_and_submit(inputs, walk)
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

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

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
            head = {**envelope(rid, name, True), "object": "chat.completion.chunk"}
            yield sse({**head, "choices": [], "usage": usage(ids, [text])})
        metrics.observe_latency(task.walk, time.perf_counter() - t0)
        yield SSE_DONE

    return ClosingStream(events(), lambda: ctx.cancel_all([handle], ticket), "text/event-stream")
