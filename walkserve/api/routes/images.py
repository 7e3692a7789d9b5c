"""``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart: a PNG, JPEG
or WebP image and a prompt, decoded by ``api.imagecodec`` under the pixel limit): one b64_json
image per request (``output_format`` png, jpeg or webp), from the profile's image walks and
noise seeded by the request's ``seed``, or by a random one when it gives none (each image
says its seed)."""

from __future__ import annotations

import base64
import secrets
import time
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from walkserve.api import imagecodec
from walkserve.api.context import ApiContext, context, unless_gone, validate
from walkserve.api.errors import ApiError, bad
from walkserve.api.form import parse_form
from walkserve.api.profile import ImageTask
from walkserve.api.schemas import ImageRequest
from walkserve.runtime.server import RequestHandle

router = APIRouter()


def image_sizes(task: ImageTask) -> list[str]:
    """The sizes (``WIDTHxHEIGHT``) the model makes, as ``size`` takes them."""
    return [f"{task.size}x{task.size}"]


def check_image_request(ctx: ApiContext, task: ImageTask, body: ImageRequest) -> list[int]:
    native = f"{task.size}x{task.size}"
    if body.size not in (None, native):
        raise bad(
            f"size {body.size!r} is not supported: this model makes {native} images only", "size"
        )
    if body.n != 1:
        raise bad(f"n={body.n} is not supported: send n=1", "n")
    if body.response_format != "b64_json":
        raise bad(
            f"response_format {body.response_format!r} is not supported: use 'b64_json'",
            "response_format",
        )
    try:
        imagecodec.image_format(body.output_format)
    except ValueError as e:
        raise bad(str(e), "output_format") from None
    if body.output_format == "png" and body.output_compression not in (None, 100):
        raise bad(
            "output_compression applies to jpeg and webp only; PNG is written lossless",
            "output_compression",
        )
    ids = task.encode(body.prompt)
    ctx.check_ids(ids, task.vocab_size, task.max_prompt_tokens, "prompt")
    return ids


async def run_image(
    ctx: ApiContext,
    request: Request,
    task: ImageTask,
    walk: str,
    inputs: dict[str, Any],
    body: ImageRequest,
) -> JSONResponse:
    """Run an image walk on ``inputs`` plus seeded noise (or the seed itself, for walks that
    take one); answer with one b64 image in the requested format."""
    seed = secrets.randbits(63) if body.seed is None else body.seed
    ticket = ctx.admission.admit()
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
        handle = await ctx.submit(inputs, walk, stream=False)  # the image alone
        outputs = await unless_gone(request, ctx.finish(handle))
    finally:
        ctx.cancel_all([] if handle is None else [handle], ticket)
    ctx.metrics.observe_latency(walk, time.perf_counter() - t0)
    fmt = imagecodec.image_format(body.output_format)
    image = outputs[task.image_output][0]  # [3, H, W]
    data = await run_in_threadpool(encode_image, task, image, fmt, body.output_compression)
    return JSONResponse(
        {
            "created": int(time.time()),
            # seed (an extension): the one drawn, so that a client can make the image again
            "data": [{"b64_json": base64.b64encode(data).decode("ascii"), "seed": seed}],
            "output_format": fmt,
            "size": image_sizes(task)[0],
        }
    )


def encode_image(
    task: ImageTask, image: torch.Tensor, fmt: imagecodec.ImageFormat, quality: int | None
) -> bytes:
    """The walk's image [3, H, W] -> ``fmt`` bytes, through the task's own 8-bit pixels if it
    has them, else from its value range."""
    if task.pixels is not None:
        return imagecodec.encode_rgb(task.pixels(image), fmt, quality)
    low, high = task.image_range
    if (low, high) != (-1.0, 1.0):  # imagecodec.encode takes [-1, 1]
        image = (image - low) * (2.0 / (high - low)) - 1.0
    return imagecodec.encode(image, fmt, quality)


@router.post("/v1/images/generations")
async def images(request: Request) -> Response:
    ctx = context(request)
    body = await ctx.parse(request, ImageRequest)
    ctx.check_model(body.model)
    task = ctx.profile.image
    if task is None:
        raise bad(f"model {ctx.name!r} has no image generation")
    ids = check_image_request(ctx, task, body)
    inputs = {task.prompt_input: torch.tensor([ids], dtype=torch.int64)}
    return await run_image(ctx, request, task, task.walk, inputs, body)


@router.post("/v1/images/edits")
async def image_edits(request: Request) -> Response:
    ctx = context(request)
    task = ctx.profile.image
    if task is None or task.edit_walk is None or task.image_input is None:
        raise ApiError(
            404,
            f"model {ctx.name!r} has no image edit walk, so /v1/images/edits is not served;"
            " use /v1/walks/{walk}",
            "not_found_error",
        )
    try:
        form = parse_form(await ctx.read_body(request), request.headers.get("content-type", ""))
    except ValueError as e:
        raise bad(str(e)) from None
    if "mask" in form.files:
        raise bad("mask is not supported: this model edits the whole image; leave it out", "mask")
    upload = form.files.get("image")
    if upload is None:
        raise bad(
            f"send the image to edit as the multipart file field 'image' ({imagecodec.ACCEPTED})",
            "image",
        )
    fields = {k: v for k, v in form.fields.items() if k != "image"}
    body = validate(fields, ImageRequest, strict=False)
    ctx.check_model(body.model)
    ids = check_image_request(ctx, task, body)
    try:
        image = await run_in_threadpool(imagecodec.decode, upload.data, ctx.config.max_image_pixels)
    except ValueError as e:
        raise bad(str(e), "image") from None
    if image.shape[1:] != (task.size, task.size):
        raise bad(
            f"the image is {image.shape[2]}x{image.shape[1]} pixels; this model edits"
            f" {task.size}x{task.size} images only",
            "image",
        )
    inputs = {
        task.prompt_input: torch.tensor([ids], dtype=torch.int64),
        task.image_input: image[None],  # [1, 3, H, W]
    }
    return await run_image(ctx, request, task, task.edit_walk, inputs, body)
