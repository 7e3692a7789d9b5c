"""The HTTP API: a FastAPI app over a running ``Server``, following the OpenAI API so that the
official ``openai`` client works unchanged.

    GET  /health                   per-rank status; 503 when a worker is dead (no auth)
    GET  /v1/models                the served model
    POST /v1/completions           text (prompt as text or token ids); SSE when stream
    POST /v1/chat/completions      chat; SSE when stream; with modalities ["text", "audio"]
                                   the reply's audio and transcript (``api.audio``)
    POST /v1/audio/speech          text in, wav or pcm out; chunked as produced when stream;
                                   ``voice`` picks one of the model's voices
    POST /v1/images/generations    b64_json PNG
    POST /v1/images/edits          multipart: PNG image + prompt -> b64_json PNG (edit walk)
    POST /v1/walks/{walk}          any walk, inputs and outputs as JSON; SSE when stream
    GET  /metrics                  Prometheus text

A request's path through here::

    body   = parse(request, Schema)          size limit, JSON, types and ranges -> 400
    inputs = task-specific checks            model, limits, tokenization        -> 400
    ticket = admit()                         --max-queued, atomic on the loop   -> 503
    handle = await server.submit_async(...)  admission by the conductor thread, awaited
    items  = handle.astream() / aresult()    awaited on the loop (woken by the conductor
                                             thread; no pool thread per request)
    ticket.release(); handle.cancel()        when the response ends or the client leaves

``n > 1`` text choices are ``n`` requests (choice i seeded ``seed + i``), their SSE chunks
merged as they come.

What crosses the boundary: the ``Server`` (runtime) and a ``ModelProfile`` (which walk does
which task); nothing here names a model.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import secrets
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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from walkserve.api import audio, jsontensor, media
from walkserve.api.form import parse_form
from walkserve.api.metrics import Metrics, PlaybackClock
from walkserve.api.profile import ChatAudioTask, ImageTask, ModelProfile, TextTask, Voice, Voices
from walkserve.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageRequest,
    SpeechRequest,
    WalkRequest,
)
from walkserve.api.textgen import (
    TextAssembler,
    all_tokens,
    chunk,
    delta,
    text_response,
    usage,
)
from walkserve.runtime.conductor import StreamItem
from walkserve.runtime.kv.engine_report import engine_choices
from walkserve.runtime.server import RequestFailed, RequestHandle, Server

B = TypeVar("B", bound=BaseModel)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is there


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


class ClientGone(ApiError):
    """The client disconnected before its (non-streamed) answer was ready."""

    def __init__(self) -> None:
        super().__init__(499, "the client disconnected", "client_closed_request")


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


class _AuthAndCount:
    """ASGI middleware: with an API key, every route but ``/health`` needs ``Authorization:
    Bearer KEY`` (401 otherwise); every response is counted by route and status. Plain ASGI
    (not Starlette's ``BaseHTTPMiddleware``), so that the routes see the client's disconnect
    and no extra task runs per request."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.expected is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.count(path, 401)
                response = JSONResponse(
                    error_body(
                        "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                    ),
                    401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        route = "/v1/walks" if path.startswith("/v1/walks/") else path
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.count(route, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class _AudioWatch:
    """Observes one streamed audio response: time to first audio, playback viability (see
    ``api.metrics``) and the real-time factor, chunk by chunk."""

    def __init__(self, metrics: Metrics, sample_rate: int, t0: float) -> None:
        self.metrics, self.sample_rate, self.t0 = metrics, sample_rate, t0
        self.clock = PlaybackClock()
        self.samples = 0

    def chunk(self, waveform: torch.Tensor) -> torch.Tensor:  # [..., samples]
        now = time.perf_counter()
        if self.clock.start is None:
            self.metrics.observe_first("audio", now - self.t0)
        self.clock.arrive(now, waveform.shape[-1] / self.sample_rate)
        self.samples += waveform.shape[-1]
        return waveform

    def rest(self, waveform: torch.Tensor | None) -> torch.Tensor | None:
        """The part of the final waveform output not streamed yet (all of it when the walk's
        waveform is a plain output, not a streamed channel); None if nothing is left."""
        if waveform is None or waveform.shape[-1] <= self.samples:
            return None
        return waveform[..., self.samples :]

    def done(self) -> None:
        self.metrics.observe_playback(self.clock)
        elapsed = time.perf_counter() - self.t0
        self.metrics.observe_real_time_factor(elapsed, self.samples / self.sample_rate)


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
MAX_CHOICES = 16  # n of a completion request
SAMPLING_INPUTS = ("temperature", "top_p", "top_k", "seed")


async def merge(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The chunks of every stream as they come, each stream's own order kept (the choices of
    an ``n > 1`` completion). The first error ends the merge and is raised."""
    if len(streams) == 1:
        async for data in streams[0]:
            yield data
        return
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue(
        4 * len(streams)
    )

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for data in stream:
                await queue.put((data, None))
            await queue.put((None, None))
        except Exception as e:
            await queue.put((None, e))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


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

    app.add_middleware(_AuthAndCount, api_key=config.api_key, metrics=metrics)

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

    def check_greedy(temperature: float | None, top_p: float | None, top_k: int | None) -> None:
        if temperature not in (None, 0.0):
            raise bad(
                f"temperature {temperature} is not supported: this model decodes greedily only;"
                " send temperature 0 or leave it out"
            )
        if top_p not in (None, 1.0):
            raise bad(f"top_p {top_p} is not supported: greedy decoding only; leave it out")
        if top_k not in (None, 0):
            raise bad(f"top_k {top_k} is not supported: greedy decoding only; leave it out")

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

    def pick_voice(voices: Voices | None, requested: str | dict[str, Any] | None) -> Voice:
        try:
            return audio.resolve_voice(voices, requested)
        except ValueError as e:
            raise bad(str(e)) from None

    def need_output(walk: str, name: str, what: str) -> None:
        """400 unless ``walk`` has output ``name`` (a profile written ahead of its walk)."""
        if name not in captured.graph.walks[walk].outputs:
            raise bad(
                f"model {profile.name!r} has no {what} yet: its walk {walk!r} has no output"
                f" {name!r}"
            )

    def walk_sampling(
        walk: str,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """The sampling inputs of ``walk`` that the request sets, plus greedy values for
        those the walk requires without a default (a seed drawn at random); none when the
        walk takes none, and then the request must not ask for sampling."""
        inputs = {i.name: i for i in captured.graph.walks[walk].inputs}
        if not inputs.keys() & set(SAMPLING_INPUTS):
            check_greedy(temperature, top_p, top_k)
            return {}
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
        greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": secrets.randbits(63)}
        out: dict[str, Any] = {}
        for name in SAMPLING_INPUTS:
            if name not in inputs:
                continue
            if given[name] is not None:
                out[name] = given[name]
            elif inputs[name].default is None:
                out[name] = greedy[name]
        return out

    async def submit(inputs: dict[str, Any], walk: str) -> RequestHandle:
        try:
            return await server.submit_async(inputs, walk)
        except (ValueError, KeyError, TypeError) as e:
            raise bad(f"the model rejected the request: {e}") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "server_error") from None

    async def admit_and_submit(
        inputs: dict[str, Any], walk: str
    ) -> tuple[_Ticket, RequestHandle, float]:
        """Admit one request (or 503) and submit it: its ticket (the caller releases it when
        the request is done), its handle and its start time."""
        ticket = admission.admit()
        t0 = time.perf_counter()
        try:
            return ticket, await submit(inputs, walk), t0
        except BaseException:
            ticket.release()
            raise

    def stream_items(handle: RequestHandle) -> AsyncIterator[StreamItem]:
        return handle.astream()

    async def drain(handle: RequestHandle, on_item: Callable[[StreamItem], None]) -> dict[str, Any]:
        """Every stream item to ``on_item``, then the outputs (raises ``RequestFailed``)."""
        async for item in handle.astream():
            on_item(item)
        return await handle.aresult()

    async def unless_gone(request: Request, work: Awaitable[T]) -> T:
        """``work``'s result, unless the client disconnects first: then ``ClientGone`` (the
        caller's cleanup cancels the request and frees its state at once, instead of running
        it to the end for nobody)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone()  # the caller's cleanup cancels (and counts) it
        finally:
            task.cancel()

    async def finish(handle: RequestHandle) -> dict[str, Any]:
        try:
            return await handle.aresult()
        except RequestFailed as e:
            raise ApiError(500, f"the request failed: {e}", "server_error") from None

    def cancel(handle: RequestHandle) -> None:
        """End the request if it is still running (the client left, or a stop string)."""
        if not handle.done():
            metrics.cancelled += 1
            handle.cancel()

    def first_observer(kind: str, channel: str, t0: float) -> Callable[[StreamItem], None]:
        """Observes the time to the first item of ``channel`` (first token or audio); for
        tokens, also the gaps between items (one decode step each): inter-token latency."""
        last: float | None = None

        def on_item(item: StreamItem) -> None:
            nonlocal last
            if item.channel != channel:
                return
            now = time.perf_counter()
            if last is None:
                metrics.observe_first(kind, now - t0)
            elif kind == "token":
                metrics.observe_inter_token(now - last)
            last = now

        return on_item

    # ------------------------------------------------------------ health, models, metrics

    engines = {  # which text engine serves each language model (the paged pool or a fallback)
        name or "model": choice.to_json()
        for name, choice in (engine_choices(captured.model) if captured is not None else {}).items()
    }

    @app.get("/health")
    async def health() -> JSONResponse:
        ranks = await run_in_threadpool(server.health)
        body = {
            "status": "ok",
            "engines": engines,
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
        kinds = ("text", "speech", "image", "chat_audio")
        tasks = [t for t in kinds if getattr(profile, t) is not None]
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
                    "engines": engines,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        stats = await run_in_threadpool(server.stats)
        kv = await run_in_threadpool(server.kv_stats)
        text = metrics.render(admission.active, config.max_queued, stats, kv)
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
        choices = sampling_inputs(task, body)
        ids = task.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt")
        return await run_text(request, task, ids, body, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        check_model(body.model)
        if "audio" in (body.modalities or []):
            return await run_chat_audio(request, body)
        if body.audio is not None:
            raise bad('audio is set but modalities has no "audio": send ["text", "audio"]')
        task = text_task()
        choices = sampling_inputs(task, body)
        prompt = task.chat_template([(m.role, m.content) for m in body.messages])
        ids = task.encode(prompt)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt (after the chat template)")
        return await run_text(request, task, ids, body, choices, chat=True)

    def sampling_inputs(
        task: TextTask, body: CompletionRequest | ChatCompletionRequest
    ) -> list[dict[str, Any]]:
        """The sampling inputs of each of the ``n`` choices (none for a greedy-only model).
        Leaving temperature out means greedy; choice ``i`` draws with seed ``seed + i`` (a
        random seed when none is given)."""
        if body.n > MAX_CHOICES:
            raise bad(f"n={body.n} is too large: at most {MAX_CHOICES} choices per request")
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
        max_tokens = check_max_tokens(limit, task.default_max_tokens, task.max_tokens_limit)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise bad("stop must be up to 4 non-empty strings")
        ticket = admission.admit()
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
                handles.append(await submit(inputs, task.walk))
        except BaseException:
            for handle in handles:
                cancel(handle)
            ticket.release()
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        texts = [TextAssembler(task, stops, max_tokens) for _ in handles]
        if not body.stream:
            try:
                try:
                    drains = asyncio.gather(
                        *(
                            drain(handle, first_observer("token", task.tokens_channel, t0))
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
                metrics.observe_latency(task.walk, time.perf_counter() - t0)
                return JSONResponse(
                    text_response(
                        rid, profile.name, chat, texts, ids, body.return_token_ids, created
                    )
                )
            finally:
                for handle in handles:
                    cancel(handle)
                ticket.release()

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def choice_events(index: int) -> AsyncIterator[bytes]:
            """One choice's SSE chunks, its finish chunk last; an error chunk if it failed."""
            handle, text = handles[index], texts[index]
            observe = first_observer("token", task.tokens_channel, t0)
            if chat:
                yield sse(
                    chunk(rid, profile.name, True, {"role": "assistant", "content": ""}, index)
                )
            pending_first = bool(task.leads)
            async for item in stream_items(handle):
                if item.channel != task.tokens_channel:
                    continue
                observe(item)
                tokens = [int(t) for t in item.value.reshape(-1).tolist()]
                if pending_first:
                    # The lead tokens are outputs sent before the channel's first item (HF:
                    # prefill's token; a walk's outputs that exist before its stream).
                    got = handle._outputs
                    tokens = [int(got[n].reshape(-1)[0]) for n in task.leads if n in got] + tokens
                    pending_first = False
                for token in tokens:
                    stopped = text.feed(token)
                    yield sse(
                        delta(rid, profile.name, chat, text.take(), [token], body, None, index)
                    )
                    if stopped:
                        break
                if text.finish_reason is not None:
                    break
            if text.finish_reason is None:  # the stream ended: did the request succeed?
                outputs = await finish(handle)
                if pending_first:  # HF: prefill finished the request, decode never ran
                    for token in all_tokens(task, outputs):
                        if text.feed(token):
                            break
            text.finish()
            tail = text.take()
            yield sse(delta(rid, profile.name, chat, tail, [], body, text.finish_reason, index))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for data in merge([choice_events(i) for i in range(len(handles))]):
                    yield data
            except ApiError as e:
                yield sse(error_body(e.message, e.kind))
                yield SSE_DONE
                return
            if include_usage:
                yield sse(
                    {
                        **chunk(rid, profile.name, chat, None),
                        "choices": [],
                        "usage": usage(ids, texts),
                    }
                )
            metrics.observe_latency(task.walk, time.perf_counter() - t0)
            yield SSE_DONE

        def close() -> None:
            for handle in handles:
                cancel(handle)
            ticket.release()

        return _ClosingStream(events(), close, "text/event-stream")

    # ------------------------------------------------------------ chat with audio output

    def chat_audio_task() -> tuple[ChatAudioTask, TextTask]:
        task = profile.chat_audio
        if task is None or profile.text is None:
            raise bad(
                f'model {profile.name!r} has no audio output: send modalities ["text"] (or'
                " leave modalities out)"
            )
        need_output(task.walk, task.waveform_channel, "audio output")
        return task, profile.text

    async def run_chat_audio(request: Request, body: ChatCompletionRequest) -> Response:
        """``modalities: ["text", "audio"]``: one request of the task's walk; the reply's text
        tokens are the transcript, its waveform the audio (see ``api.audio``)."""
        task, text_task_ = chat_audio_task()
        params = body.audio
        if params is None:
            raise bad('modalities has "audio": send audio: {"voice": ..., "format": "wav"}')
        try:
            fmt = audio.chat_audio_format(params.format)
        except ValueError as e:
            raise bad(str(e)) from None
        if body.n != 1:
            raise bad(f"n={body.n} is not supported with audio output: send n=1")
        if body.stop:
            raise bad("stop is not supported with audio output (the audio would not stop)")
        voice = pick_voice(task.voices, params.voice)
        prompt = text_task_.chat_template([(m.role, m.content) for m in body.messages])
        ids = text_task_.encode(prompt)
        check_ids(
            ids,
            text_task_.vocab_size,
            text_task_.max_prompt_tokens,
            "prompt (after the chat template)",
        )
        limit = body.max_completion_tokens or body.max_tokens
        max_tokens = check_max_tokens(
            limit, text_task_.default_max_tokens, text_task_.max_tokens_limit
        )
        inputs = {
            task.prompt_input: torch.tensor([ids], dtype=torch.int64),
            task.max_tokens_input: max_tokens,
            **task.extra_inputs,
            **voice.inputs,
            **walk_sampling(task.walk, body.temperature, body.top_p, body.top_k, body.seed),
        }
        ticket, handle, t0 = await admit_and_submit(inputs, task.walk)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        audio_ref = audio.audio_id()
        text = TextAssembler(text_task_, [], max_tokens)
        if not body.stream:
            try:
                on_audio = first_observer("audio", task.waveform_channel, t0)
                on_token = first_observer("token", task.transcript_channel, t0)

                def on_item(item: StreamItem) -> None:
                    on_audio(item)
                    on_token(item)

                try:
                    outputs = await unless_gone(request, drain(handle, on_item))
                except RequestFailed as e:
                    raise ApiError(500, f"the request failed: {e}", "server_error") from None
            finally:
                handle.cancel()
                ticket.release()
            audio.Transcript(text, task.leads, task.transcript_channel).finish(outputs)
            waveform = outputs[task.waveform_channel]
            elapsed = time.perf_counter() - t0
            metrics.observe_latency(task.walk, elapsed)
            metrics.observe_real_time_factor(elapsed, waveform.shape[-1] / task.sample_rate)
            data = audio.audio_bytes(waveform, fmt, task.sample_rate)
            return JSONResponse(
                audio.chat_audio_response(
                    rid,
                    profile.name,
                    created,
                    audio_ref,
                    data,
                    text.text,
                    text.finish_reason,
                    usage(ids, [text]),
                )
            )

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def piece(**fields: Any) -> bytes:
            return sse(audio.audio_chunk(rid, profile.name, {"id": audio_ref, **fields}))

        async def events() -> AsyncIterator[bytes]:
            yield sse(audio.audio_chunk(rid, profile.name, None, role=True))
            watch = _AudioWatch(metrics, task.sample_rate, t0)
            observe = first_observer("token", task.transcript_channel, t0)
            header = fmt == "wav"  # a streamed WAV: the header (sizes open) leads the data
            said = audio.Transcript(text, task.leads, task.transcript_channel)
            try:
                async for item in stream_items(handle):
                    if item.channel == task.transcript_channel:
                        observe(item)
                        if piece_text := said.stream(item.value, handle._outputs):
                            yield piece(transcript=piece_text)
                    elif item.channel == task.waveform_channel:
                        data = media.pcm16(watch.chunk(item.value))
                        if header:
                            data, header = media.wav_header(task.sample_rate, None) + data, False
                        yield piece(data=audio.b64(data))
                outputs = await finish(handle)
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
                    rid, profile.name, {"id": audio_ref, "expires_at": expires}, text.finish_reason
                )
            )
            if include_usage:
                yield sse(
                    {
                        **chunk(rid, profile.name, True, None),
                        "choices": [],
                        "usage": usage(ids, [text]),
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
        need_output(task.walk, task.waveform_channel, "speech output")
        if body.speed != 1.0:
            raise bad(f"speed {body.speed} is not supported; send 1.0 or leave it out")
        voice = pick_voice(task.voices, body.voice)
        ids = task.encode(voice.prefix + body.input)
        check_ids(ids, task.vocab_size, task.max_prompt_tokens, "input")
        max_tokens = check_max_tokens(
            body.max_tokens, task.default_max_tokens, task.max_tokens_limit
        )
        inputs = {
            task.prompt_input: torch.tensor([ids], dtype=torch.int64),
            task.max_tokens_input: max_tokens,
            **task.extra_inputs,
            **voice.inputs,
            **walk_sampling(task.walk),
        }
        ticket, handle, t0 = await admit_and_submit(inputs, task.walk)
        as_wav = body.response_format == "wav"
        media_type = "audio/wav" if as_wav else "audio/pcm"
        if not body.stream:
            try:
                on_item = first_observer("audio", task.waveform_channel, t0)
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
                handle.cancel()
                ticket.release()

        async def chunks() -> AsyncIterator[bytes]:
            if as_wav:
                yield media.wav_header(task.sample_rate, None)
            watch = _AudioWatch(metrics, task.sample_rate, t0)
            async for item in stream_items(handle):
                if item.channel == task.waveform_channel:
                    yield media.pcm16(watch.chunk(item.value))
            outputs = await finish(handle)
            rest = watch.rest(outputs.get(task.waveform_channel))
            if rest is not None:
                yield media.pcm16(watch.chunk(rest))
            watch.done()
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
        request: Request, task: ImageTask, walk: str, inputs: dict[str, Any], seed: int
    ) -> JSONResponse:
        """Run an image walk on ``inputs`` plus seeded noise (or the seed itself, for walks
        that take one); answer with one b64 PNG."""
        ticket = admission.admit()
        t0 = time.perf_counter()
        handle: RequestHandle | None = None
        try:
            edit = walk == task.edit_walk
            noise_input = (edit and task.edit_noise_input) or task.noise_input
            noise_shape = (edit and task.edit_noise_shape) or task.noise_shape
            if noise_input is not None:
                generator = torch.Generator().manual_seed(seed)
                inputs[noise_input] = torch.randn((1, *noise_shape), generator=generator)
            if task.seed_input is not None:
                inputs[task.seed_input] = torch.tensor([seed], dtype=torch.int64)
            if task.extra_inputs is not None:
                inputs.update(task.extra_inputs(walk))
            handle = await submit(inputs, walk)
            outputs = await unless_gone(request, finish(handle))
        finally:
            if handle is not None:
                cancel(handle)
            ticket.release()
        image = outputs[task.image_output][0]  # [3, H, W]
        low, high = task.image_range
        if (low, high) != (-1.0, 1.0):  # media.png takes [-1, 1]
            image = (image - low) * (2.0 / (high - low)) - 1.0
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
        return await run_image(request, task, task.walk, inputs, body.seed)

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
        return await run_image(request, task, task.edit_walk, inputs, body.seed)

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
        ticket, handle, t0 = await admit_and_submit(inputs, walk)
        if not body.stream:
            try:
                outputs = await unless_gone(request, finish(handle))
            finally:
                cancel(handle)
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
