"""The SD3 walks served on real worker processes: ``serve("walkserve.adapters.diffusers_dit:tiny")``
on one rank and with the two guidance branches on two ranks; 4 concurrent ``generate`` requests
with different prompts, seeds, step counts and guidance scales, and 2 ``edit`` requests
(img2img) in flight with them.

Served outputs are compared with the reference interpreter by
``walkserve.testing.assert_outputs_match`` (floats within 1e-5 of max|reference|: requests at
different steps share batched transformer calls; that module says why), and with diffusers'
``StableDiffusion3Pipeline`` (``StableDiffusion3Img2ImgPipeline`` for edits) within ``TOLERANCE`` (justified in tests/unit/test_diffusers_dit.py:
the pipeline runs the two branches as one batch of 2). ``/v1/images/generations`` is driven
and ``/v1/images/edits`` through the app on the one-rank server."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from walkserve import capture
from walkserve.adapters import diffusers_dit as D
from walkserve.adapters.diffusers_upstream import pipeline_edit_image, pipeline_image
from walkserve.adapters.registry import capture_model, profile_for
from walkserve.api import imagecodec, media
from walkserve.api.app import create_app
from walkserve.runtime.server import Server, serve
from walkserve.testing import assert_outputs_match

NAME = "walkserve.adapters.diffusers_dit:tiny"
TWO_RANKS = "walkserve/adapters/placements/diffusers-dit.2ranks.yaml"
TOLERANCE = 2e-5  # served (or reference) image vs the pipeline's, images in [0, 1]
REQUESTS = [  # prompt, seed, steps, guidance scale
    ("a red square", 1, 2, 5.0),
    ("blue", 2, 4, 3.0),
    ("", 3, 3, 7.5),
    ("green circle", 4, 1, 2.0),
]
EDITS = [("make it blue", 5, 4, 0.6), ("sharper", 6, 3, 1.0)]  # prompt, seed, steps, strength

PIXELS = 1 << 20  # the pixel limit of the test's own decodes


@pytest.fixture(scope="module")
def reference() -> tuple[D.SD3Walks, capture.CapturedModel, list[dict[str, Any]]]:
    captured = capture_model(NAME)  # traced once; both servers reuse it
    walks = captured.model
    assert isinstance(walks, D.SD3Walks)
    reqs = [
        D.request_inputs(walks, p, seed=s, steps=n, guidance_scale=g) for p, s, n, g in REQUESTS
    ]
    edits = [
        D.edit_inputs(walks, p, edit_image(seed), seed=seed, steps=n, strength=st)
        for p, seed, n, st in EDITS
    ]
    return walks, captured, reqs, edits


def edit_image(seed: int) -> torch.Tensor:
    return torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))  # [0, 1]


@pytest.fixture(scope="module")
def one_rank(reference: Any) -> Iterator[Server]:
    with serve(reference[1]) as server:
        yield server


def check_concurrent(server: Server, reference: Any) -> None:
    walks, captured, reqs, edits = reference
    # Queued together, admitted in one round of the conductor loop: all in flight at once,
    # in phase (one by one, each would be admitted while the previous one's first node ran).
    futures = [server.submit_future(r, "generate") for r in reqs]
    edit_futures = [server.submit_future(r, "edit") for r in edits]
    handles = [f.result() for f in futures]
    edit_handles = [f.result() for f in edit_futures]
    for handle, r, (prompt, seed, steps, g) in zip(handles, reqs, REQUESTS, strict=True):
        got = handle.result(timeout=120)
        assert_outputs_match(got, captured.run(r, walk="generate"))
        want = pipeline_image(walks, r, prompt, seed=seed, steps=steps, guidance_scale=g)
        assert (got["image"] - want).abs().max().item() <= TOLERANCE
    for handle, r, (prompt, seed, steps, strength) in zip(edit_handles, edits, EDITS, strict=True):
        got = handle.result(timeout=120)
        assert_outputs_match(got, captured.run(r, walk="edit"))
        want = pipeline_edit_image(
            walks, prompt, edit_image(seed), seed=seed, steps=steps, strength=strength
        )
        assert (got["image"] - want).abs().max().item() <= TOLERANCE
    stats = server.stats()
    assert stats.live_requests == 0 and stats.live_values == 0


def test_one_rank_four_concurrent_requests(one_rank: Server, reference: Any) -> None:
    check_concurrent(one_rank, reference)
    assert max(one_rank.batch_sizes) > 1, one_rank.batch_sizes  # branches/requests batched


def test_guidance_branches_on_two_ranks(reference: Any) -> None:
    with serve(reference[1], TWO_RANKS) as server:
        check_concurrent(server, reference)
        assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}


def test_images_generations_route(one_rank: Server, reference: Any) -> None:
    walks = reference[0]
    client = TestClient(create_app(one_rank, profile_for(NAME)))
    body = {"model": NAME, "prompt": "a cat", "size": "32x32", "seed": 9}
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    got = media.image_to_uint8(imagecodec.decode(png, PIXELS))  # [H, W, 3]
    # The route's defaults: negative prompt "", 4 steps, guidance 5, latents from the seed.
    inputs = D.request_inputs(walks, "a cat", seed=9, steps=4, guidance_scale=5.0)
    want = pipeline_image(walks, inputs, "a cat", seed=9, steps=4, guidance_scale=5.0)[0]
    expected = media.image_to_uint8(want * 2 - 1)  # [H, W, 3]
    # 8-bit pixels: equal up to one level where a value sits on a rounding boundary.
    assert (got.int() - expected.int()).abs().max().item() <= 1
    assert (got != expected).float().mean().item() < 0.01
    r = client.post("/v1/images/generations", json={**body, "size": "64x64"})
    assert r.status_code == 400 and "32x32" in r.json()["error"]["message"]
    assert torch.equal(got, media.image_to_uint8(imagecodec.decode(png, PIXELS)))


def test_images_edits_route(one_rank: Server, reference: Any) -> None:
    walks = reference[0]
    client = TestClient(create_app(one_rank, profile_for(NAME)))
    png = media.png(edit_image(8)[0] * 2 - 1)  # 32x32 RGB
    image01 = (imagecodec.decode(png, PIXELS)[None] + 1) / 2  # [1, 3, 32, 32]: the server's
    fields = {"model": NAME, "prompt": "make it blue", "size": "32x32", "seed": "4"}
    r = client.post("/v1/images/edits", data=fields, files={"image": ("in.png", png, "image/png")})
    assert r.status_code == 200, r.text
    out = base64.b64decode(r.json()["data"][0]["b64_json"])
    got = media.image_to_uint8(imagecodec.decode(out, PIXELS))
    # The route's defaults: negative prompt "", 4 steps, strength 0.6, guidance 5.
    want = pipeline_edit_image(
        walks, "make it blue", image01, seed=4, steps=4, strength=0.6, guidance_scale=5.0
    )[0]
    expected = media.image_to_uint8(want * 2 - 1)  # [H, W, 3]
    assert (got.int() - expected.int()).abs().max().item() <= 1
    assert (got != expected).float().mean().item() < 0.01
