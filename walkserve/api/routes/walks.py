"""``POST /v1/walks/{walk}``: any entry walk of the model, inputs and outputs as JSON
(``api.jsontensor``); SSE of the walk's stream items when ``stream``. Bounded by
``ApiConfig.walk_limits`` (input lengths, loop bounds, rows: 400s naming the input); a
request holds one admission place per row."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from walkserve.api import jsontensor
from walkserve.api.context import context, stream_batches, unless_gone
from walkserve.api.errors import ApiError, bad, error_body
from walkserve.api.jsonsafe import dumps
from walkserve.api.schemas import WalkRequest
from walkserve.api.sse import SSE_DONE, ClosingStream, sse
from walkserve.capture import ir
from walkserve.capture.inputs import InputError
from walkserve.runtime.kv import grammar as kv_grammar
from walkserve.runtime.limits import check_limits, fan_out

router = APIRouter()


def _batch_input(graph: ir.WalkGraph, walk: str) -> str:
    """The field named when a walk's rows are more than admission ever takes."""
    batched = [i.name for i in graph.walks[walk].inputs if i.spec and i.spec.kind == "tensor"]
    return f"inputs.{batched[0]}" if batched else "inputs"


def check_constraints(value: Any, vocab: int) -> None:
    """The text walks' ``constraints`` (``runtime.kv.grammar.Constraints``) checked here, as
    the text routes check theirs: a bad one would fail the whole batch of the KV engine that
    reads it (it keeps state, so its batch is not retried call by call)."""
    try:
        wanted = kv_grammar.decode(value if isinstance(value, torch.Tensor) else None)
    except ValueError as e:
        raise bad(str(e), "inputs.constraints") from None
    if any(not 0 <= t < vocab for t, _ in wanted.logit_bias):
        raise bad(f"constraints: logit_bias ids must be in [0, {vocab})", "inputs.constraints")
    if wanted.grammar is not None and (why := kv_grammar.check_grammar(wanted.grammar)):
        raise bad(f"constraints: the grammar cannot be used: {why}", "inputs.constraints")


@router.post("/v1/walks/{walk}")
async def run_walk(walk: str, request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, WalkRequest)
    ctx.check_model(body.model)
    graph = ctx.server.captured.graph
    if walk not in graph.walks:
        raise bad(f"unknown walk {walk!r}; the model has {sorted(graph.walks)}")
    try:
        inputs = jsontensor.decode_inputs(ctx.server.captured, walk, body.inputs)
    except ValueError as e:
        raise bad(str(e), "inputs") from None
    text = ctx.profile.text
    if text is not None and walk == text.ext_walk:
        check_constraints(inputs.get("constraints"), text.vocab_size)
    try:  # bounded work: lengths, loop bounds, rows (each row counts at admission)
        check_limits(graph, walk, inputs, ctx.config.walk_limits)
    except InputError as e:
        raise bad(str(e), f"inputs.{e.input}") from None
    rows = fan_out(graph, walk, inputs)
    ticket, handle, t0 = await ctx.admit_and_submit(
        inputs, walk, rows, _batch_input(graph, walk), stream=body.stream
    )
    if not body.stream:
        try:
            outputs = await unless_gone(request, ctx.finish(handle))
        finally:
            ctx.cancel_all([handle], ticket)
        ctx.metrics.observe_latency(walk, time.perf_counter() - t0)
        encoded = {k: jsontensor.to_json(v, body.encoding) for k, v in outputs.items()}
        return Response(dumps({"walk": walk, "outputs": encoded}), media_type="application/json")

    async def events() -> AsyncIterator[bytes]:
        async for batch in stream_batches(handle):  # the items that came together: one write
            yield b"".join(
                sse(
                    {
                        "channel": item.channel,
                        "index": item.index,
                        "value": jsontensor.to_json(item.value, body.encoding),
                    }
                )
                for item in batch
            )
        try:
            outputs = await ctx.finish(handle)
        except ApiError as e:
            yield sse(error_body(e.message, e.kind))
        else:
            yield sse(
                {"outputs": {k: jsontensor.to_json(v, body.encoding) for k, v in outputs.items()}}
            )
        ctx.metrics.observe_latency(walk, time.perf_counter() - t0)
        yield SSE_DONE

    return ClosingStream(events(), lambda: ctx.cancel_all([handle], ticket), "text/event-stream")
