"""``POST /v1/completions``, and the text generation it shares with chat: ``plan_text`` turns
a request's fields into walk inputs (sampling, penalties, logit bias, grammar, logprobs) after
checking each against the model, and ``run_text`` runs its ``n`` choices (``n`` requests,
choice i seeded ``seed + i``), merging their SSE chunks as they come.

A request that asks for logprobs, a logit bias or a grammar runs the profile's ``ext_walk``
(``prefill_ext``); the others run its plain walk. Rules for values a client may send that the
sampler cannot use as they are (documented in the README): ``top_k`` of -1, 0 or at least the
vocabulary size is off (all tokens); a ``temperature`` below 1e-5 is greedy; ``ignore_eos`` is
``min_tokens = max_tokens`` (the EOS is never drawn); ``seed`` is taken modulo 2**63."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from walkserve.api import jsontensor, structured
from walkserve.api.context import ApiContext, check_greedy, context, drain, unless_gone
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.jsonsafe import dumps
from walkserve.api.profile import TextTask
from walkserve.api.schemas import MAX_LOGIT_BIAS, MAX_STOP, ChatCompletionRequest, CompletionRequest
from walkserve.api.sse import SSE_DONE, ClosingStream, merge, sse
from walkserve.api.textgen import (
    Choice,
    Step,
    StepStream,
    TextAssembler,
    completion_logprobs,
    envelope,
    steps_from_outputs,
    usage,
)
from walkserve.runtime.kv import grammar as kv_grammar
from walkserve.runtime.server import RequestFailed, RequestHandle

router = APIRouter()
MAX_CHOICES = 16  # n of a completion request
SAMPLING_EPS = 1e-5  # the sampler's: below it, greedy
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
TextBody = CompletionRequest | ChatCompletionRequest


def text_task(ctx: ApiContext) -> TextTask:
    if ctx.profile.text is None:
        raise bad(f"model {ctx.name!r} has no text generation; use /v1/walks/{{walk}}")
    return ctx.profile.text


@dataclass
class TextPlan:
    """What ``run_text`` runs: the walk, the inputs shared by every choice, each choice's
    sampling inputs, and how the reply is assembled."""

    walk: str
    prompt: list[int]
    max_tokens: int
    stops: list[str]
    shared: dict[str, Any]
    choices: list[dict[str, Any]]
    logprob_columns: int = 0  # per token; 0: no logprobs
    echo: str = ""  # text put before the reply (completions' echo)
    grammar: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the route's own (tools)


def walk_inputs(ctx: ApiContext, walk: str) -> set[str]:
    return set(jsontensor.required_inputs(ctx.server.captured, walk))


def plan_text(
    ctx: ApiContext,
    task: TextTask,
    body: TextBody,
    prompt: list[int],
    logprob_columns: int,
    grammar: str | None,
) -> TextPlan:
    """Check every generation field of ``body`` against the model; the plan to run it."""
    limit = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        limit = body.max_completion_tokens
    default = task.default_max_tokens
    if task.max_model_len is not None:
        default = max(1, min(default, task.max_model_len - len(prompt)))
    max_tokens = ctx.check_max_tokens(limit, default, task.max_tokens_limit)
    if task.max_model_len is not None and len(prompt) + max_tokens > task.max_model_len:
        raise bad(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is more than"
            f" this server's max model length of {task.max_model_len} tokens",
            "max_tokens",
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"stop must be up to {MAX_STOP} non-empty strings", "stop")
    bias = logit_bias(body, task.vocab_size)
    ext = bool(bias) or grammar is not None or logprob_columns > 0
    walk = task.walk
    if ext:
        field_name = "logit_bias" if bias else "logprobs" if logprob_columns else "response_format"
        if task.ext_walk is None:
            raise bad(f"{field_name} is not supported by model {ctx.name!r}", field_name)
        if grammar is not None and not task.structured_output:
            raise bad(f"model {ctx.name!r} has no vocabulary for structured output", field_name)
        walk = task.ext_walk
    takes = walk_inputs(ctx, walk)
    shared: dict[str, Any] = {task.max_tokens_input: max_tokens, **task.extra_inputs}
    for name in PENALTIES:
        value = getattr(body, name)
        if value is None or value == (1.0 if name == "repetition_penalty" else 0.0):
            continue
        if name not in takes:
            raise bad(f"{name} is not supported by model {ctx.name!r}", name)
        shared[name] = float(value)
    min_tokens = max_tokens if body.ignore_eos else body.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad(f"min_tokens {min_tokens} is more than max_tokens {max_tokens}", "min_tokens")
    if min_tokens:
        if "min_tokens" not in takes:
            what = "ignore_eos" if body.ignore_eos else "min_tokens"
            raise bad(f"{what} is not supported by model {ctx.name!r}", what)
        shared["min_tokens"] = min_tokens
    if ext:
        constraints = kv_grammar.Constraints(grammar=grammar, logit_bias=bias)
        shared["constraints"] = kv_grammar.encode(constraints)
        shared["logprobs"] = logprob_columns
    return TextPlan(
        walk,
        prompt,
        max_tokens,
        stops,
        shared,
        sampling_inputs(task, body),
        logprob_columns,
        grammar=grammar,
    )


def logit_bias(body: TextBody, vocab: int) -> list[tuple[int, float]]:
    if not body.logit_bias:
        return []
    if len(body.logit_bias) > MAX_LOGIT_BIAS:
        raise bad(
            f"logit_bias has {len(body.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias"
        )
    out = []
    for key, value in body.logit_bias.items():
        if not key.isdecimal() or len(key) > 12 or not 0 <= int(key) < vocab:
            raise bad(
                f"logit_bias key {key[:20]!r} is not a token id in [0, {vocab})", "logit_bias"
            )
        out.append((int(key), float(value)))
    return out


def request_grammar(body: TextBody) -> str | None:
    try:
        return structured.request_grammar(
            body.response_format, body.guided_json, body.guided_regex, body.guided_choice
        )
    except ValueError as e:
        raise bad(str(e), "response_format") from None


def sampling_inputs(task: TextTask, body: TextBody) -> list[dict[str, Any]]:
    """The sampling inputs of each of the ``n`` choices (none for a greedy-only model).
    Leaving temperature out means greedy; choice ``i`` draws with seed ``seed + i`` (a random
    seed when none is given)."""
    if body.n > MAX_CHOICES:
        raise bad(f"n={body.n} is too large: at most {MAX_CHOICES} choices per request", "n")
    top_k = body.top_k or 0
    if top_k < 0 or top_k >= task.vocab_size:
        top_k = 0  # -1 (vLLM's "off") or the whole vocabulary: every token
    temperature = body.temperature or 0.0
    if temperature < SAMPLING_EPS:
        temperature = 0.0
    if not task.sampling:
        check_greedy(temperature, body.top_p, top_k)
        return [{} for _ in range(body.n)]
    seed = body.seed % 2**63 if body.seed is not None else secrets.randbits(63)
    top_p = 1.0 if body.top_p is None else body.top_p
    return [
        {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": (seed + i) % 2**63}
        for i in range(body.n)
    ]


def check_prompt(ctx: ApiContext, task: TextTask, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise bad("a list of prompts is not supported: send one prompt per request", "prompt")
    if isinstance(prompt, str):
        if not task.has_tokenizer:
            raise bad(_NO_TOKENIZER, "prompt")
        ids = task.encode(prompt)
    else:
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
    ctx.check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt")
    return ids


_NO_TOKENIZER = (
    "this server has no tokenizer (--skip-tokenizer-init, or the checkpoint has none):"
    " send the prompt as token ids"
)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, CompletionRequest)
    ctx.check_model(body.model)
    task = text_task(ctx)
    if body.suffix is not None:
        raise bad("suffix is not supported: the served models do not fill in the middle", "suffix")
    if body.best_of not in (None, body.n):
        raise bad("best_of is not supported: send n choices and rank them yourself", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad("echo with logprobs is not supported: prompt logprobs are not computed", "echo")
    ids = check_prompt(ctx, task, body)
    columns = 0 if body.logprobs is None else body.logprobs + 1
    plan = plan_text(ctx, task, body, ids, columns, request_grammar(body))
    if body.echo:
        plan.echo = body.prompt if isinstance(body.prompt, str) else task.decode(ids)
    return await run_text(ctx, request, task, plan, body, CompletionShape(task, body))


class CompletionShape:
    """The completions API's bodies: ``choices[i].text`` and its logprobs."""

    chat = False

    def __init__(self, task: TextTask, body: CompletionRequest) -> None:
        self.task, self.body = task, body
        self.top = body.logprobs or 0

    def choice(self, index: int, c: Choice, echo: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": index,
            "text": echo + c.text.text,
            "finish_reason": c.text.finish_reason,
            "logprobs": None,
        }
        if self.body.logprobs is not None:
            out["logprobs"] = completion_logprobs(self.task, c.kept, self.top, len(echo))
        if self.body.return_token_ids:
            out["token_ids"] = list(c.text.tokens)
        return out

    def start(self, index: int, echo: str) -> list[dict[str, Any]]:
        return (
            [{"index": index, "text": echo, "finish_reason": None, "logprobs": None}]
            if echo
            else []
        )

    def delta(
        self, index: int, c: Choice, text: str, steps: list[Step], final: bool
    ) -> list[dict[str, Any]]:
        out: dict[str, Any] = {
            "index": index,
            "text": text,
            "finish_reason": c.text.finish_reason if final else None,
            "logprobs": None,
        }
        if self.body.logprobs is not None:
            offset = len(c.text.text) - len(text)
            out["logprobs"] = completion_logprobs(self.task, steps, self.top, offset)
        if self.body.return_token_ids:
            out["token_ids"] = [s.token for s in steps]
        return [out]


Shape = Any  # CompletionShape or routes.chat.ChatShape: choice(), start(), delta(), chat


async def run_text(
    ctx: ApiContext,
    request: Request,
    task: TextTask,
    plan: TextPlan,
    body: TextBody,
    shape: Shape,
) -> Response:
    ticket = ctx.admission.admit(len(plan.choices))  # each choice runs as a request
    t0 = time.perf_counter()
    handles: list[RequestHandle] = []
    try:
        prompt = torch.tensor([plan.prompt], dtype=torch.int64)
        for sampling in plan.choices:
            inputs = {task.prompt_input: prompt, **plan.shared, **sampling}
            handles.append(await ctx.submit(inputs, plan.walk))
    except BaseException:
        ctx.cancel_all(handles, ticket)
        raise
    rid = f"{'chatcmpl' if shape.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    name = ctx.name
    choices = [Choice(TextAssembler(task, plan.stops, plan.max_tokens)) for _ in handles]
    with_logprobs = plan.logprob_columns > 0
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
            for c, outputs in zip(choices, results):
                for step in steps_from_outputs(task, outputs):
                    if c.feed(step):
                        break
                c.text.finish()
            reason = choices[0].text.finish_reason or "stop"
            ctx.metrics.observe_latency(task.walk, time.perf_counter() - t0, reason)
            ctx.metrics.observe_tokens(len(plan.prompt), sum(c.text.generated for c in choices))
            answer = {
                **envelope(rid, name, shape.chat, ctx.created),
                "choices": [shape.choice(i, c, plan.echo) for i, c in enumerate(choices)],
                "usage": usage(plan.prompt, [c.text for c in choices]),
            }
            if body.return_token_ids:
                answer["prompt_token_ids"] = list(plan.prompt)
            return Response(dumps(answer), media_type="application/json")
        finally:
            ctx.cancel_all(handles, ticket)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    kind = "chat.completion.chunk" if shape.chat else "text_completion"

    def frame(parts: list[dict[str, Any]]) -> bytes:
        return sse({**envelope(rid, name, shape.chat), "object": kind, "choices": parts})

    async def choice_events(index: int) -> AsyncIterator[bytes]:
        """One choice's SSE chunks, its finish chunk last."""
        handle, c = handles[index], choices[index]
        observe = ctx.first_observer("token", task.tokens_channel, t0)
        if parts := shape.start(index, plan.echo):
            yield frame(parts)
        steps = StepStream(task, with_logprobs)
        async for batch in handle.abatches():  # the tokens that came together: one write
            chunks: list[bytes] = []
            for item in batch:
                if item.channel == task.tokens_channel:
                    observe(item)
                new = [] if steps.started else steps.lead(handle.outputs())
                new += steps.add(item)
                for step in new:
                    stopped = c.feed(step)
                    kept = c.kept[-1:] if c.kept and c.kept[-1] is step else []
                    if parts := shape.delta(index, c, c.text.take(), kept, False):
                        chunks.append(frame(parts))
                    if stopped:
                        break
                if c.text.finish_reason is not None:
                    break
            if chunks:
                yield b"".join(chunks)
            if c.text.finish_reason is not None:
                break
        if c.text.finish_reason is None:  # the stream ended: did the request succeed?
            outputs = await ctx.finish(handle)
            for step in steps.rest(outputs, c.fed):  # prefill finished it: no stream
                if c.feed(step):
                    break
        c.text.finish()
        yield frame(shape.delta(index, c, c.text.take(), [], True))

    async def events() -> AsyncIterator[bytes]:
        try:
            async for data in merge([choice_events(i) for i in range(len(handles))]):
                yield data
        except ApiError as e:
            yield sse(error_body(e.message, e.kind))
            yield SSE_DONE
            return
        if include_usage:
            texts = [c.text for c in choices]
            yield sse(
                {
                    **envelope(rid, name, shape.chat),
                    "object": kind,
                    "choices": [],
                    "usage": usage(plan.prompt, texts),
                }
            )
        reason = choices[0].text.finish_reason or "stop"
        ctx.metrics.observe_latency(task.walk, time.perf_counter() - t0, reason)
        ctx.metrics.observe_tokens(len(plan.prompt), sum(c.text.generated for c in choices))
        yield SSE_DONE

    return ClosingStream(events(), lambda: ctx.cancel_all(handles, ticket), "text/event-stream")


Observer = Callable[[Any], None]
