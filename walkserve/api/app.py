"""The HTTP API: a FastAPI app over a running ``Server``, following the OpenAI API so that the
official ``openai`` client works unchanged.

    GET  /health                   per-rank status; 503 when a worker is dead (no auth)
    GET  /v1/models                the served model
    POST /v1/completions           text (prompt as text or token ids); SSE when stream
    POST /v1/chat/completions      chat; SSE when stream
    POST /v1/audio/speech          text in, wav or pcm out; chunked as produced when stream
    POST /v1/images/generations    b64_json PNG
    POST /v1/images/edits          multipart: PNG image + prompt -> b64_json PNG (edit walk)
    POST /v1/walks/{walk}          any walk, inputs and outputs as JSON; SSE when stream
    GET  /metrics                  Prometheus text

A request's path through here::

    body   = parse(request, Schema)          size limit, JSON, types and ranges -> 400
    inputs = task-specific checks            model, limits, tokenization        -> 400
    ticket = admit()                         --max-queued, atomic on the loop   -> 503
    handle = server.submit(inputs, walk)     in a pool thread, never on the loop
    items  = handle.stream() / result()      in pool threads; SSE chunks as they arrive
    ticket.release(); handle.cancel()        when the response ends or the client leaves

What crosses the boundary: the ``Server`` (runtime) and a ``ModelProfile`` (which walk does
which task); nothing here names a model.
"""

from __future__ import annotations

import base64
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from walkserve.api import jsontensor, media
from walkserve.api.form import parse_form
from walkserve.api.metrics import Metrics
from walkserve.api.profile import ImageTask, ModelProfile, TextTask
from walkserve.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageRequest,
    SpeechRequest,
    WalkRequest,
)
from walkserve.api.textgen import TextAssembler, all_tokens, chunk, delta, text_response
from walkserve.runtime.conductor import StreamItem
from walkserve.runtime.server import RequestFailed, RequestHandle, Server

B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True)
class ApiConfig:
    api_key: str | None = None
    max_queued: int | None = None  # admitted requests at once; None: no limit
    max_body_bytes: int = 8 << 20
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def bad(message: str) -> ApiError:
    return ApiError(400, message)


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class _Admission:
    """Counts admitted requests. Runs on the event loop only, so check-and-increment is
    atomic (no await in between)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.active = 0

    def admit(self) -> _Ticket:
        if self.limit is not None and self.active >= self.limit:
            raise ApiError(
                503,
                f"the server is at its limit of {self.limit} queued requests; retry later",
                "server_busy",
            )
        self.active += 1
        return _Ticket(self)


class _Ticket:
    def __init__(self, admission: _Admission) -> None:
        self._admission: _Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.active -= 1
            self._admission = None


class _ClosingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (finished, client gone,
    cancelled)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def create_app(server: Server, profile: ModelProfile, config: ApiConfig | None = None) -> FastAPI:
    """The app serving ``server`` (already started; the caller closes it)."""
    config = config or ApiConfig()
    app = FastAPI(title="walkserve", docs_url=None, redoc_url=None, openapi_url=None)
    admission = _Admission(config.max_queued)
    metrics = Metrics()
    captured = server.captured
    created = int(time.time())

    # ------------------------------------------------------------ errors, auth, parsing

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 503 and exc.kind == "server_busy":
            metrics.rejected_full += 1
            headers = {"Retry-After": str(config.retry_after_s)}
        else:
            headers = exc.headers or {}
        return JSONResponse(error_body(exc.message, exc.kind), exc.status, headers=headers)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"no route {request.url.path}", "not_found_error"), 404)

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"{request.method} is not allowed on {request.url.path}"), 405
        )

    @app.middleware("http")
    async def _auth_and_count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if config.api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            expected = f"Bearer {config.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                metrics.count(request.url.path, 401)
                return JSONResponse(
                    error_body(
                        "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                    ),
                    401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        response = await call_next(request)
        route = request.url.path if not request.url.path.startswith("/v1/walks/") else "/v1/walks"
        metrics.count(route, response.status_code)
        return response

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise bad(f"the request body is {declared} bytes; the limit is {config.max_body_bytes}")
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > config.max_body_bytes:
                raise bad(f"the request body is over the limit of {config.max_body_bytes} bytes")
            chunks.append(piece)
        return b"".join(chunks)

    async def parse(request: Request, schema: type[B]) -> B:
        body = await read_body(request)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise bad("the request body must be a JSON object")
        return validate(data, schema)

    def validate(data: dict[str, Any], schema: type[B]) -> B:
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                for err in e.errors()
            )
            raise bad(f"invalid request: {problems}") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != profile.name:
            raise bad(f"model {name!r} is not served here; this server serves {profile.name!r}")

    def check_greedy(temperature: float | None, top_p: float | None, n: int) -> None:
        if temperature not in (None, 0.0):
            raise bad(
                f"temperature {temperature} is not supported: this model decodes greedily only;"
                " send temperature 0 or leave it out"
            )
        if top_p not in (None, 1.0):
            raise bad(f"top_p {top_p} is not supported: greedy decoding only; leave it out")
        if n != 1:
            raise bad(f"n={n} is not supported: send n=1 (one choice per request)")

    def check_ids(ids: list[int], vocab: int, limit: int, what: str) -> None:
        if not ids:
            raise bad(f"the {what} is empty; send at least one token")
        if len(ids) > limit:
            raise bad(f"the {what} is {len(ids)} tokens; the limit is {limit}")
        wrong = [i for i in ids if not 0 <= i < vocab]
        if wrong:
            raise bad(f"the {what} has token ids outside [0, {vocab}): {wrong[:5]}")

    def check_max_tokens(value: int | None, default: int, limit: int) -> int:
        value = default if value is None else value
        if value > limit:
            raise bad(f"max_tokens {value} is too large: at most {limit} for this model")
        return value

    async def submit(inputs: dict[str, Any], walk: str) -> RequestHandle:
        try:
            return await run_in_threadpool(server.submit, inputs, walk)
        except (ValueError, KeyError, TypeError) as e:
            raise bad(f"the model rejected the request: {e}") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "server_error") from None

    async def stream_items(handle: RequestHandle) -> AsyncIterator[StreamItem]:
        items = handle.stream()
        while True:
            item = await run_in_threadpool(next, items, None)
            if item is None:
                return
            yield item

    def drain(handle: RequestHandle, on_item: Callable[[StreamItem], None]) -> dict[str, Any]:
        for item in handle.stream():
            on_item(item)
        return handle.result()

    async def finish(handle: RequestHandle) -> dict[str, Any]:
        try:
            return await run_in_threadpool(handle.result)
        except RequestFailed as e:
            raise ApiError(500, f"the request failed: {e}", "server_error") from None

    def cancel(handle: RequestHandle) -> None:
        """End the request if it is still running (the client left, or a stop string)."""
        if not handle.done():
            metrics.cancelled += 1
            handle.cancel()

    def first_observer(kind: str, channel: str, t0: float) -> Callable[[StreamItem], None]:
        seen = False

        def on_item(item: StreamItem) -> None:
            nonlocal seen
            if not seen and item.channel == channel:
                seen = True
                metrics.observe_first(kind, time.perf_counter() - t0)

        return on_item

    # ------------------------------------------------------------ health, models, metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        ranks = await run_in_threadpool(server.health)
        body = {
            "status": "ok",
            "ranks": {
                str(r): {
                    "status": h.status,
                    "pid": h.pid,
                    "in_flight": h.in_flight,
                    "error": h.error,
                }
                for r, h in ranks.items()
            },
        }
        if any(h.status in ("dead", "closed") for h in ranks.values()):
            body["status"] = "unavailable"
            return JSONResponse(body, 503)
        return JSONResponse(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        tasks = [t for t in ("text", "speech", "image") if getattr(profile, t) is not None]
        return {
            "object": "list",
            "data": [
                {
                    "id": profile.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "walkserve",
                    "tasks": tasks,
                    "walks": captured.graph.entry_walks(),
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        stats = await run_in_threadpool(server.stats)
        text = metrics.render(admission.active, config.max_queued, stats)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------ text

    def text_task() -> TextTask:
        if profile.text is None:
            raise bad(f"model {profile.name!r} has no text generation; use /v1/walks/{{walk}}")
        return profile.text

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        check_model(body.model)
        task = text_task()
        check_greedy(body.temperature, body.top_p, body.n)
        ids = task.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt")
        return await run_text(task, ids, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        check_model(body.model)
        task = text_task()
        check_greedy(body.temperature, body.top_p, body.n)
        prompt = task.chat_template([(m.role, m.content) for m in body.messages])
        ids = task.encode(prompt)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt (after the chat template)")
        return await run_text(task, ids, body, chat=True)

    async def run_text(
        task: TextTask, ids: list[int], body: CompletionRequest | ChatCompletionRequest, chat: bool
    ) -> Response:
        limit = body.max_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            limit = body.max_completion_tokens
        max_tokens = check_max_tokens(limit, task.default_max_tokens, task.max_tokens_limit)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise bad("stop must be up to 4 non-empty strings")
        ticket = admission.admit()
        t0 = time.perf_counter()
        try:
            inputs = {
                task.prompt_input: torch.tensor([ids], dtype=torch.int64),
                task.max_tokens_input: max_tokens,
            }
            handle = await submit(inputs, task.walk)
        except BaseException:
            ticket.release()
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        text = TextAssembler(task, stops, max_tokens)
        if not body.stream:
            try:
                on_item = first_observer("token", task.tokens_channel, t0)
                try:
                    outputs = await run_in_threadpool(drain, handle, on_item)
                except RequestFailed as e:
                    raise ApiError(500, f"the request failed: {e}", "server_error") from None
                for token in all_tokens(task, outputs):
                    if text.feed(token):
                        break
                text.finish()
                metrics.observe_latency(task.walk, time.perf_counter() - t0)
                return JSONResponse(
                    text_response(
                        rid, profile.name, chat, text, ids, body.return_token_ids, created
                    )
                )
            finally:
                handle.cancel()
                ticket.release()

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            first = True
            if chat:
                yield sse(chunk(rid, profile.name, True, {"role": "assistant", "content": ""}))
            first_name = task.first_token_output
            pending_first = first_name is not None
            async for item in stream_items(handle):
                if item.channel != task.tokens_channel:
                    continue
                if first:
                    metrics.observe_first("token", time.perf_counter() - t0)
                    first = False
                tokens = [int(t) for t in item.value.reshape(-1).tolist()]
                if first_name is not None and pending_first:
                    # HF: prefill's token is an output routed before decode's first item.
                    tokens = [int(handle._outputs[first_name]), *tokens]
                    pending_first = False
                for token in tokens:
                    stopped = text.feed(token)
                    yield sse(delta(rid, profile.name, chat, text.take(), [token], body))
                    if stopped:
                        break
                if text.finish_reason is not None:
                    break
            if text.finish_reason is None:  # the stream ended: did the request succeed?
                try:
                    outputs = await finish(handle)
                except ApiError as e:
                    yield sse(error_body(e.message, e.kind))
                    yield SSE_DONE
                    return
                if pending_first:  # HF: prefill finished the request, decode never ran
                    for token in all_tokens(task, outputs):
                        if text.feed(token):
                            break
            text.finish()
            tail = text.take()
            yield sse(delta(rid, profile.name, chat, tail, [], body, text.finish_reason))
            if include_usage:
                yield sse(
                    {
                        **chunk(rid, profile.name, chat, None),
                        "choices": [],
                        "usage": text.usage(ids),
                    }
                )
            metrics.observe_latency(task.walk, time.perf_counter() - t0)
            yield SSE_DONE

        def close() -> None:
            cancel(handle)
            ticket.release()

        return _ClosingStream(events(), close, "text/event-stream")

    # ------------------------------------------------------------ speech

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        body = await parse(request, SpeechRequest)
        check_model(body.model)
        task = profile.speech
        if task is None:
            raise bad(f"model {profile.name!r} has no speech generation")
        if body.speed != 1.0:
            raise bad(f"speed {body.speed} is not supported; send 1.0 or leave it out")
        ids = task.encode(body.input)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "input")
        max_tokens = check_max_tokens(
            body.max_tokens, task.default_max_tokens, task.max_tokens_limit
        )
        ticket = admission.admit()
        t0 = time.perf_counter()
        try:
            inputs = {
                task.prompt_input: torch.tensor([ids], dtype=torch.int64),
                task.max_tokens_input: max_tokens,
            }
            handle = await submit(inputs, task.walk)
        except BaseException:
            ticket.release()
            raise
        as_wav = body.response_format == "wav"
        media_type = "audio/wav" if as_wav else "audio/pcm"
        if not body.stream:
            try:
                on_item = first_observer("audio", task.waveform_channel, t0)
                try:
                    outputs = await run_in_threadpool(drain, handle, on_item)
                except RequestFailed as e:
                    raise ApiError(500, f"the request failed: {e}", "server_error") from None
                waveform = outputs[task.waveform_channel]
                data = media.wav(waveform, task.sample_rate) if as_wav else media.pcm16(waveform)
                metrics.observe_latency(task.walk, time.perf_counter() - t0)
                return Response(data, media_type=media_type)
            finally:
                handle.cancel()
                ticket.release()

        async def chunks() -> AsyncIterator[bytes]:
            if as_wav:
                yield media.wav_header(task.sample_rate, None)
            first = True
            async for item in stream_items(handle):
                if item.channel != task.waveform_channel:
                    continue
                if first:
                    metrics.observe_first("audio", time.perf_counter() - t0)
                    first = False
                yield media.pcm16(item.value)
            await finish(handle)
            metrics.observe_latency(task.walk, time.perf_counter() - t0)

        def close() -> None:
            cancel(handle)
            ticket.release()

        return _ClosingStream(chunks(), close, media_type)

    # ------------------------------------------------------------ images

    def check_image_request(task: ImageTask, body: ImageRequest) -> list[int]:
        native = f"{task.size}x{task.size}"
        if body.size not in (None, native):
            raise bad(f"size {body.size!r} is not supported: this model makes {native} images only")
        if body.n != 1:
            raise bad(f"n={body.n} is not supported: send n=1")
        if body.response_format != "b64_json":
            raise bad("response_format 'url' is not supported: use 'b64_json'")
        ids = task.encode(body.prompt)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt")
        return ids

    async def run_image(
        task: ImageTask, walk: str, inputs: dict[str, Any], seed: int
    ) -> JSONResponse:
        """Run an image walk on ``inputs`` plus seeded noise (or the seed itself, for walks
        that take one); answer with one b64 PNG."""
        ticket = admission.admit()
        t0 = time.perf_counter()
        try:
            if task.noise_input is not None:
                generator = torch.Generator().manual_seed(seed)
                inputs[task.noise_input] = torch.randn((1, *task.noise_shape), generator=generator)
            if task.seed_input is not None:
                inputs[task.seed_input] = torch.tensor([seed], dtype=torch.int64)
            handle = await submit(inputs, walk)
            outputs = await finish(handle)
        finally:
            ticket.release()
        image = outputs[task.image_output][0]  # [3, H, W]
        metrics.observe_latency(walk, time.perf_counter() - t0)
        return JSONResponse(
            {
                "created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(media.png(image)).decode("ascii")}],
            }
        )

    @app.post("/v1/images/generations")
    async def images(request: Request) -> Response:
        body = await parse(request, ImageRequest)
        check_model(body.model)
        task = profile.image
        if task is None:
            raise bad(f"model {profile.name!r} has no image generation")
        ids = check_image_request(task, body)
        inputs = {task.prompt_input: torch.tensor([ids], dtype=torch.int64)}
        return await run_image(task, task.walk, inputs, body.seed)

    @app.post("/v1/images/edits")
    async def image_edits(request: Request) -> Response:
        task = profile.image
        if task is None or task.edit_walk is None or task.image_input is None:
            raise ApiError(
                404,
                f"model {profile.name!r} has no image edit walk, so /v1/images/edits is not"
                " served; use /v1/walks/{walk}",
                "not_found_error",
            )
        try:
            form = parse_form(await read_body(request), request.headers.get("content-type", ""))
        except ValueError as e:
            raise bad(str(e)) from None
        if "mask" in form.files:
            raise bad("mask is not supported: this model edits the whole image; leave it out")
        upload = form.files.get("image")
        if upload is None:
            raise bad("send the image to edit as the multipart file field 'image' (a PNG)")
        body = validate({k: v for k, v in form.fields.items() if k != "image"}, ImageRequest)
        check_model(body.model)
        ids = check_image_request(task, body)
        try:
            image = media.read_png(upload.data)  # [3, H, W] in [-1, 1]
        except ValueError as e:
            raise bad(str(e)) from None
        if image.shape[1:] != (task.size, task.size):
            raise bad(
                f"the image is {image.shape[2]}x{image.shape[1]} pixels; this model edits"
                f" {task.size}x{task.size} images only"
            )
        inputs = {
            task.prompt_input: torch.tensor([ids], dtype=torch.int64),
            task.image_input: image[None],  # [1, 3, H, W]
        }
        return await run_image(task, task.edit_walk, inputs, body.seed)

    # ------------------------------------------------------------ any walk

    @app.post("/v1/walks/{walk}")
    async def run_walk(walk: str, request: Request) -> Response:
        body = await parse(request, WalkRequest)
        check_model(body.model)
        if walk not in captured.graph.walks:
            raise bad(f"unknown walk {walk!r}; the model has {sorted(captured.graph.walks)}")
        try:
            inputs = jsontensor.decode_inputs(captured, walk, body.inputs)
        except ValueError as e:
            raise bad(str(e)) from None
        ticket = admission.admit()
        t0 = time.perf_counter()
        try:
            handle = await submit(inputs, walk)
        except BaseException:
            ticket.release()
            raise
        if not body.stream:
            try:
                outputs = await finish(handle)
            finally:
                handle.cancel()
                ticket.release()
            metrics.observe_latency(walk, time.perf_counter() - t0)
            return JSONResponse(
                {
                    "walk": walk,
                    "outputs": {
                        k: jsontensor.to_json(v, body.encoding) for k, v in outputs.items()
                    },
                }
            )

        async def events() -> AsyncIterator[bytes]:
            async for item in stream_items(handle):
                value = jsontensor.to_json(item.value, body.encoding)
                yield sse({"channel": item.channel, "index": item.index, "value": value})
            try:
                outputs = await finish(handle)
            except ApiError as e:
                yield sse(error_body(e.message, e.kind))
            else:
                encoded = {k: jsontensor.to_json(v, body.encoding) for k, v in outputs.items()}
                yield sse({"outputs": encoded})
            metrics.observe_latency(walk, time.perf_counter() - t0)
            yield SSE_DONE

        def close() -> None:
            cancel(handle)
            ticket.release()

        return _ClosingStream(events(), close, "text/event-stream")

    return app
