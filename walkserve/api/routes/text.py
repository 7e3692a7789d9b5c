"""``POST /v1/completions``, and the text generation it shares with chat
(``run_text``): ``n`` choices are ``n`` requests (choice i seeded ``seed + i``), their SSE
chunks merged as they come; each choice's tokens go through a ``TextAssembler`` (EOS, stop
strings, ``max_tokens``)."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from walkserve.api.context import (
    ApiContext,
    check_greedy,
    context,
    drain,
    stream_items,
    unless_gone,
)
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.profile import TextTask
from walkserve.api.schemas import ChatCompletionRequest, CompletionRequest
from walkserve.api.sse import SSE_DONE, ClosingStream, merge, sse
from walkserve.api.textgen import TextAssembler, all_tokens, chunk, delta, text_response, usage
from walkserve.runtime.server import RequestFailed, RequestHandle

router = APIRouter()
MAX_CHOICES = 16  # n of a completion request


def text_task(ctx: ApiContext) -> TextTask:
    if ctx.profile.text is None:
        raise bad(f"model {ctx.name!r} has no text generation; use /v1/walks/{{walk}}")
    return ctx.profile.text


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, CompletionRequest)
    ctx.check_model(body.model)
    task = text_task(ctx)
    choices = sampling_inputs(task, body)
    ids = task.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    ctx.check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt")
    return await run_text(ctx, request, task, ids, body, choices, chat=False)


def sampling_inputs(
    task: TextTask, body: CompletionRequest | ChatCompletionRequest
) -> list[dict[str, Any]]:
    """The sampling inputs of each of the ``n`` choices (none for a greedy-only model).
    Leaving temperature out means greedy; choice ``i`` draws with seed ``seed + i`` (a random
    seed when none is given)."""
    if body.n > MAX_CHOICES:
        raise bad(f"n={body.n} is too large: at most {MAX_CHOICES} choices per request", "n")
    if not task.sampling:
        check_greedy(body.temperature, body.top_p, body.top_k)
        return [{} for _ in range(body.n)]
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    return [
        {
            "temperature": body.temperature or 0.0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_k": body.top_k or 0,
            "seed": (seed + i) % 2**63,
        }
        for i in range(body.n)
    ]


async def run_text(
    ctx: ApiContext,
    request: Request,
    task: TextTask,
    ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    choices: list[dict[str, Any]],
    chat: bool,
) -> Response:
    limit = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        limit = body.max_completion_tokens
    max_tokens = ctx.check_max_tokens(limit, task.default_max_tokens, task.max_tokens_limit)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops) or len(stops) > 4:
        raise bad("stop must be up to 4 non-empty strings", "stop")
    ticket = ctx.admission.admit()
    t0 = time.perf_counter()
    handles: list[RequestHandle] = []
    try:
        prompt = torch.tensor([ids], dtype=torch.int64)
        for sampling in choices:
            inputs = {
                task.prompt_input: prompt,
                task.max_tokens_input: max_tokens,
                **task.extra_inputs,
                **sampling,
            }
            handles.append(await ctx.submit(inputs, task.walk))
    except BaseException:
        ctx.cancel_all(handles, ticket)
        raise
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    name = ctx.name
    texts = [TextAssembler(task, stops, max_tokens) for _ in handles]
    if not body.stream:
        try:
            try:
                drains = asyncio.gather(
                    *(
                        drain(handle, ctx.first_observer("token", task.tokens_channel, t0))
                        for handle in handles
                    )
                )
                results = await unless_gone(request, drains)
            except RequestFailed as e:
                raise ApiError(500, f"the request failed: {e}", "server_error") from None
            for text, outputs in zip(texts, results):
                for token in all_tokens(task, outputs):
                    if text.feed(token):
                        break
                text.finish()
            ctx.metrics.observe_latency(task.walk, time.perf_counter() - t0)
            return JSONResponse(
                text_response(rid, name, chat, texts, ids, body.return_token_ids, ctx.created)
            )
        finally:
            ctx.cancel_all(handles, ticket)

    include_usage = bool((body.stream_options or {}).get("include_usage"))

    async def choice_events(index: int) -> AsyncIterator[bytes]:
        """One choice's SSE chunks, its finish chunk last; an error chunk if it failed."""
        handle, text = handles[index], texts[index]
        observe = ctx.first_observer("token", task.tokens_channel, t0)
        if chat:
            yield sse(chunk(rid, name, True, {"role": "assistant", "content": ""}, index))
        pending_first = bool(task.leads)
        async for item in stream_items(handle):
            if item.channel != task.tokens_channel:
                continue
            observe(item)
            tokens = [int(t) for t in item.value.reshape(-1).tolist()]
            if pending_first:
                # The lead tokens are outputs sent before the channel's first item (HF:
                # prefill's token; a walk's outputs that exist before its stream).
                got = handle.outputs()
                tokens = [int(got[n].reshape(-1)[0]) for n in task.leads if n in got] + tokens
                pending_first = False
            for token in tokens:
                stopped = text.feed(token)
                yield sse(delta(rid, name, chat, text.take(), [token], body, None, index))
                if stopped:
                    break
            if text.finish_reason is not None:
                break
        if text.finish_reason is None:  # the stream ended: did the request succeed?
            outputs = await ctx.finish(handle)
            if pending_first:  # HF: prefill finished the request, decode never ran
                for token in all_tokens(task, outputs):
                    if text.feed(token):
                        break
        text.finish()
        tail = text.take()
        yield sse(delta(rid, name, chat, tail, [], body, text.finish_reason, index))

    async def events() -> AsyncIterator[bytes]:
        try:
            async for data in merge([choice_events(i) for i in range(len(handles))]):
                yield data
        except ApiError as e:
            yield sse(error_body(e.message, e.kind))
            yield SSE_DONE
            return
        if include_usage:
            yield sse({**chunk(rid, name, chat, None), "choices": [], "usage": usage(ids, texts)})
        ctx.metrics.observe_latency(task.walk, time.perf_counter() - t0)
        yield SSE_DONE

    return ClosingStream(events(), lambda: ctx.cancel_all(handles, ticket), "text/event-stream")
