"""The HTTP API: a FastAPI app over a running ``Server``, following the OpenAI API so that the
official ``openai`` client works unchanged. The routes live in ``api.routes`` (one module per
family); what they share is one ``ApiContext`` (``api.context``), built here.

    GET  /health                   per-rank status; 503 when a worker is dead (no auth)
    GET  /v1/models                the served model names
    POST /v1/completions           text (prompt as text or token ids); SSE when stream
    POST /v1/chat/completions      chat; SSE when stream; with modalities ["text", "audio"]
                                   the reply's audio and transcript (``api.audio``)
    POST /v1/audio/speech          text in, mp3/opus/aac/flac/wav/pcm out (``api.audiocodec``);
                                   chunked as encoded when stream; OpenAI's SSE events when
                                   stream_format "sse"; ``voice`` picks one of the model's voices
    POST /v1/audio/transcriptions  multipart: an audio file -> its text (models that read audio)
    POST /v1/images/generations    b64_json PNG, JPEG or WebP
    POST /v1/images/edits          multipart: PNG/JPEG/WebP image + prompt -> b64_json image
    POST /v1/walks/{walk}          any walk, inputs and outputs as JSON; SSE when stream
    GET  /metrics                  Prometheus text

A request's path through here::

    body   = ctx.parse(request, Schema)      size limit, safe JSON, types and ranges -> 400
    inputs = task-specific checks            model, limits, tokenization        -> 400
    ticket = admit()                         --max-queued, atomic on the loop   -> 503
    handle = await server.submit_async(...)  admission by a conductor pass, awaited
    items  = handle.astream() / aresult()    awaited on the loop (woken by the conductor
                                             thread; no pool thread per request)
    ticket.release(); handle.cancel()        when the response ends or the client leaves

Every failure answers the JSON error shape (``api.errors``): an ``ApiError`` with its status, a
request the framework could not route 404/405, and any other exception a 500 that names its
type (and is logged), never a plain-text traceback.

What crosses the boundary: the ``Server`` (runtime) and a ``ModelProfile`` (which walk does
which task); nothing here names a model.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from walkserve.api.context import ApiConfig, ApiContext
from walkserve.api.errors import ApiError, error_body
from walkserve.api.middleware import AuthAndCount
from walkserve.api.profile import ModelProfile
from walkserve.api.routes import ROUTERS
from walkserve.runtime.server import Server

__all__ = ["ApiConfig", "create_app"]

log = logging.getLogger("walkserve.api")


def create_app(server: Server, profile: ModelProfile, config: ApiConfig | None = None) -> FastAPI:
    """The app serving ``server`` (already started; the caller closes it)."""
    config = config or ApiConfig()
    app = FastAPI(title="walkserve", docs_url=None, redoc_url=None, openapi_url=None)
    ctx = ApiContext(server, profile, config)
    app.state.ctx = ctx
    for router in ROUTERS:
        app.include_router(router)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = exc.headers or {}
        if exc.status == 503 and exc.kind == "server_busy":
            ctx.metrics.count_rejected()
            headers = {"Retry-After": str(config.retry_after_s)}
        return JSONResponse(
            error_body(exc.message, exc.kind, exc.param), exc.status, headers=headers
        )

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body("no such route", "not_found_error"), 404)

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{request.method} is not allowed on this route"), 405)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(
            error_body(
                f"internal error ({type(exc).__name__}); see the server log", "server_error"
            ),
            500,
        )

    routes = [route for router in ROUTERS for route in router.routes]  # the leaf routes
    app.add_middleware(AuthAndCount, api_key=config.api_key, metrics=ctx.metrics, routes=routes)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
