"""``ApiContext``: what every route shares, built once by ``create_app``: the running
``Server``, the served ``ModelProfile``, the limits (``ApiConfig``), the metrics, admission
and the request helpers every route uses (body parsing, checks against the profile, submit,
await, cancel). A route reads it with ``context(request)``; nothing else is shared."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from walkserve.api import audio, jsonsafe
from walkserve.api.admission import Admission, Ticket
from walkserve.api.errors import ApiError, ClientGone, bad
from walkserve.api.mediafetch import MediaFetch
from walkserve.api.metrics import Metrics
from walkserve.api.profile import ModelProfile, Voice, Voices
from walkserve.runtime.conductor import StreamItem
from walkserve.runtime.limits import WalkLimits
from walkserve.runtime.server import RequestFailed, RequestHandle, Server

B = TypeVar("B", bound=BaseModel)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is there
SAMPLING_INPUTS = ("temperature", "top_p", "top_k", "seed")
DEFAULT_WALK_LIMITS = WalkLimits(max_input_length=32768, max_loop_bound=65536, max_batch=32)


@dataclass(frozen=True)
class ApiConfig:
    api_key: str | None = None
    max_queued: int | None = None  # admitted requests at once; None: no limit
    max_body_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096  # an uploaded image's width x height, checked before decode
    retry_after_s: int = 1
    served_names: tuple[str, ...] = ()  # names clients may send as ``model`` (the first is
    # the one answers carry); empty: the profile's name
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    # ``/v1/walks/*``: how long its inputs, how many loop iterations and rows one request may
    # ask for (``runtime.limits``); the task routes have their profile's limits
    walk_limits: WalkLimits = field(default_factory=lambda: DEFAULT_WALK_LIMITS)
    media: MediaFetch = field(default_factory=MediaFetch)  # image URLs besides data URLs

    def __post_init__(self) -> None:
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if any(not n for n in self.served_names):
            raise ValueError("a served model name must not be empty")


@dataclass
class ApiContext:
    server: Server
    profile: ModelProfile
    config: ApiConfig
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        gate = getattr(self.server, "unavailable", lambda: None)  # a test's stand-in may lack it
        self.admission = Admission(self.config.max_queued, gate, self.config.retry_after_s)
        self.names = self.config.served_names or (self.profile.name,)
        self.metrics = Metrics(self.names[0])

    @property
    def name(self) -> str:
        """The model name answers carry."""
        return self.names[0]

    # ------------------------------------------------------------ parsing

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise bad(f"the request body is {declared} bytes; the limit is {limit}")
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise bad(f"the request body is over the limit of {limit} bytes")
            chunks.append(piece)
        return b"".join(chunks)

    async def parse(self, request: Request, schema: type[B]) -> B:
        body = await self.read_body(request)
        try:
            data = jsonsafe.loads(body)
        except ValueError as e:
            raise bad(str(e)) from None
        if not isinstance(data, dict):
            raise bad("the request body must be a JSON object")
        return validate(data, schema)

    # ------------------------------------------------------------ checks

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            served = self.names[0] if len(self.names) == 1 else list(self.names)
            raise bad(f"model {name!r} is not served here; this server serves {served!r}", "model")

    def check_ids(self, ids: Sequence[int], vocab: int, limit: int, what: str) -> None:
        if not ids:
            raise bad(f"the {what} is empty; send at least one token")
        if len(ids) > limit:
            raise bad(f"the {what} is {len(ids)} tokens; the limit is {limit}")
        wrong = [i for i in ids if not 0 <= i < vocab]
        if wrong:
            raise bad(f"the {what} has token ids outside [0, {vocab}): {wrong[:5]}")

    def check_max_tokens(self, value: int | None, default: int, limit: int) -> int:
        value = default if value is None else value
        if value > limit:
            raise bad(
                f"max_tokens {value} is too large: at most {limit} for this model", "max_tokens"
            )
        return value

    def pick_voice(self, voices: Voices | None, requested: str | dict[str, Any] | None) -> Voice:
        try:
            return audio.resolve_voice(voices, requested)
        except ValueError as e:
            raise bad(str(e), "voice") from None

    def need_output(self, walk: str, name: str, what: str) -> None:
        """400 unless ``walk`` has output ``name`` (a profile written ahead of its walk)."""
        if name not in self.server.captured.graph.walks[walk].outputs:
            raise bad(
                f"model {self.name!r} has no {what} yet: its walk {walk!r} has no output {name!r}"
            )

    def walk_sampling(
        self,
        walk: str,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """The sampling inputs of ``walk`` that the request sets, plus greedy values for
        those the walk requires without a default (a seed drawn at random); none when the
        walk takes none, and then the request must not ask for sampling."""
        inputs = {i.name: i for i in self.server.captured.graph.walks[walk].inputs}
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

    # ------------------------------------------------------------ running requests

    async def submit(self, inputs: dict[str, Any], walk: str, stream: bool = True) -> RequestHandle:
        """Submit a request; ``stream=False`` where the answer reads none of its stream items
        (a non-streamed answer): its ranks then report nothing item by item, only its outputs
        (a 30-step rollout's states would otherwise come back step by step as well)."""
        t0 = time.perf_counter()
        try:
            handle = await self.server.submit_async(inputs, walk, stream=stream)
            self.metrics.observe_queue(time.perf_counter() - t0)
            return handle
        except (ValueError, KeyError, TypeError) as e:
            # capture's InputError (a ValueError) names the walk input at fault: ``input``
            raise bad(f"the model rejected the request: {e}", getattr(e, "input", None)) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "server_error") from None

    async def admit_and_submit(
        self,
        inputs: dict[str, Any],
        walk: str,
        weight: int = 1,
        param: str = "n",
        stream: bool = True,
    ) -> tuple[Ticket, RequestHandle, float]:
        """Admit one request (or 503) and submit it: its ticket (the caller releases it when
        the request is done), its handle and its start time. ``weight``: what it runs
        (``Admission.admit``; ``param`` names the field that sets it); ``stream``: as
        ``submit``'s."""
        ticket = self.admission.admit(weight, param)
        t0 = time.perf_counter()
        try:
            return ticket, await self.submit(inputs, walk, stream), t0
        except BaseException:
            ticket.release()
            raise

    async def finish(self, handle: RequestHandle) -> dict[str, Any]:
        try:
            return await handle.aresult()
        except RequestFailed as e:
            raise ApiError(500, f"the request failed: {e}", "server_error") from None

    def cancel(self, handle: RequestHandle) -> None:
        """End the request if it is still running (the client left, or a stop string)."""
        if not handle.done():
            self.metrics.count_cancelled()
            handle.cancel()

    def cancel_all(self, handles: Iterable[RequestHandle], ticket: Ticket) -> None:
        for handle in handles:
            self.cancel(handle)
        ticket.release()

    def first_observer(self, kind: str, channel: str, t0: float) -> Callable[[StreamItem], None]:
        """Observes the time to the first item of ``channel`` (first token or audio); for
        tokens, also the gaps between items (one decode step each): inter-token latency."""
        last: float | None = None
        metrics = self.metrics

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


def context(request: Request) -> ApiContext:
    """The context of the app serving ``request``."""
    ctx: ApiContext = request.app.state.ctx
    return ctx


def validate(data: dict[str, Any], schema: type[B], strict: bool = True) -> B:
    """``data`` as ``schema`` or a 400 naming each field at fault (an unknown one as such);
    ``strict=False`` for form fields, which are all strings."""
    try:
        return schema.model_validate(data, strict=strict)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        problems = []
        for err in errors[:8]:
            where = ".".join(str(p) for p in err["loc"]) or "body"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown field {where!r}: this route does not take it")
            elif err["type"] == "refused_field":
                problems.append(f"{where}: {err['msg']}" if err["loc"] else err["msg"])
            else:
                problems.append(f"{where}: {err['msg']}")
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        raise bad(f"invalid request: {'; '.join(problems)}", param or None) from None


def check_greedy(temperature: float | None, top_p: float | None, top_k: int | None) -> None:
    if temperature not in (None, 0.0):
        raise bad(
            f"temperature {temperature} is not supported: this model decodes greedily only;"
            " send temperature 0 or leave it out",
            "temperature",
        )
    if top_p not in (None, 1.0):
        raise bad(f"top_p {top_p} is not supported: greedy decoding only; leave it out", "top_p")
    if top_k not in (None, 0):
        raise bad(f"top_k {top_k} is not supported: greedy decoding only; leave it out", "top_k")


async def drain(handle: RequestHandle, on_item: Callable[[StreamItem], None]) -> dict[str, Any]:
    """Every stream item to ``on_item``, then the outputs (raises ``RequestFailed``)."""
    async for item in handle.astream():
        on_item(item)
    return await handle.aresult()


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``ClientGone`` (the
    caller's cleanup cancels the request and frees its state at once, instead of running it to
    the end for nobody)."""
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


def stream_items(handle: RequestHandle) -> AsyncIterator[StreamItem]:
    return handle.astream()


def stream_batches(handle: RequestHandle) -> AsyncIterator[list[StreamItem]]:
    """The stream items as they came together (``RequestHandle.abatches``): one write each."""
    return handle.abatches()
