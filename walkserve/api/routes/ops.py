"""Operations routes: ``/health`` (per-rank status and restarts; 503 while a rank is not
ready (restarting, failed) or the server drains or stopped; no auth), ``/v1/models`` (the
served names, their tasks and walks, the image sizes and media formats) and ``/metrics``
(Prometheus text)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from walkserve.api import audiocodec, imagecodec
from walkserve.api.context import context
from walkserve.api.routes.images import image_sizes

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ctx = context(request)
    ranks = await run_in_threadpool(ctx.server.health)
    body: dict[str, Any] = {
        "status": "ok",
        "ranks": {
            str(r): {
                "status": h.status,
                "pid": h.pid,
                "in_flight": h.in_flight,
                "error": h.error,
                "restarts": h.restarts,
                "shm_pool": h.shm_pool,
            }
            for r, h in ranks.items()
        },
    }
    fatal = getattr(ctx.server, "fatal", None)
    if fatal is not None:  # the conductor loop stopped: nothing will be served
        body["status"] = "unavailable"
        body["conductor"] = {"status": "stopped", "error": fatal}
        return JSONResponse(body, 503)
    draining = getattr(ctx.server, "draining", None)
    if draining is not None:
        body["status"] = "draining"
        return JSONResponse(body, 503, headers={"Retry-After": str(ctx.config.retry_after_s)})
    if any(h.status not in ("ready", "unresponsive") for h in ranks.values()):
        body["status"] = "unavailable"  # a rank restarting (Retry-After) or failed for good
        return JSONResponse(body, 503, headers={"Retry-After": str(ctx.config.retry_after_s)})
    return JSONResponse(body)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = context(request)
    profile = ctx.profile
    kinds = ("text", "speech", "image", "chat_audio", "transcription", "chat_media")
    tasks = [t for t in kinds if getattr(profile, t) is not None]
    walks = ctx.server.captured.graph.entry_walks()
    media_fields: dict[str, Any] = {}
    if profile.image is not None:  # what size and output_format take
        media_fields["image_sizes"] = image_sizes(profile.image)
        media_fields["image_formats"] = list(imagecodec.IMAGE_FORMATS)
    if profile.speech is not None:
        media_fields["speech_formats"] = list(audiocodec.SPEECH_FORMATS)
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": ctx.created,
                "owned_by": "walkserve",
                "root": profile.name,
                "max_model_len": profile.text.max_prompt_tokens + profile.text.max_tokens_limit
                if profile.text is not None
                else None,
                "tasks": tasks,
                "walks": walks,
                **media_fields,
            }
            for name in ctx.names
        ],
    }


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    ctx = context(request)
    stats = await run_in_threadpool(ctx.server.stats)
    kv = await run_in_threadpool(ctx.server.kv_stats)
    text = ctx.metrics.render(ctx.admission.active, ctx.config.max_queued, stats, kv)
    return Response(text, media_type="text/plain; version=0.0.4")
