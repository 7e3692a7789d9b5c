"""Janus image generation served on a real worker process: concurrent requests with different
seeds and prompt lengths equal the reference interpreter (image tokens identical, pixels within
``walkserve.testing``'s tolerance), share batched steps, and leave the worker's KV pool empty;
``/v1/images/generations`` reaches the walk. One server for the module (start-up dominates)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from walkserve import capture
from walkserve.adapters import janus
from walkserve.adapters.registry import capture_model
from walkserve.runtime.server import Server, serve
from walkserve.testing import assert_outputs_match, assert_pixels_match

FACTORY = "walkserve.adapters.janus:tiny"


@pytest.fixture(scope="module")
def captured() -> capture.CapturedModel:
    return capture_model(FACTORY)


@pytest.fixture(scope="module")
def server(captured: capture.CapturedModel) -> Iterator[Server]:
    with serve(captured) as s:
        yield s


def _pixels(png: bytes) -> Any:
    import io

    import numpy as np
    from PIL import Image

    return np.array(Image.open(io.BytesIO(png)))


def pool_usage(server: Server) -> list[list[int]]:
    """(pages in use, sequences, requests) of the worker's pool."""
    out = server.submit({"probe": torch.zeros(1)}, "pool_usage").result(timeout=60)
    return out["usage"].tolist()  # type: ignore[no-any-return]


def test_four_concurrent_requests_match_the_interpreter_and_free_their_pages(
    captured: capture.CapturedModel, server: Server
) -> None:
    prompts = [(40, 50, 60), (70, 80), (90, 91, 92, 93), (7, 8, 9)]
    reqs = [
        {"input_ids": janus.sample_inputs(p)["input_ids"], "seed": torch.tensor([s])}
        for p, s in zip(prompts, (11, 22, 33, 44))
    ]
    handles = [server.submit(r, "generate") for r in reqs]  # all in flight at once
    for handle, r in zip(handles, reqs):
        assert_outputs_match(handle.result(timeout=300), captured.run(r, walk="generate"))
    assert pool_usage(server) == [[0, 0, 0]]
    assert max(server.batch_sizes) > 1, server.batch_sizes  # steps shared a forward
    assert captured.model.kv.pool.pages_in_use == 0  # the interpreter's pool too


def test_understanding_requests_match_the_interpreter(
    captured: capture.CapturedModel, server: Server
) -> None:
    reqs = [janus.understand_inputs(p, max_new_tokens=n) for p, n in [((40, 50), 6), ((9,), 10)]]
    handles = [server.submit(r, "understand") for r in reqs]
    for handle, r in zip(handles, reqs):
        assert_outputs_match(handle.result(timeout=300), captured.run(r, walk="understand"))
    assert pool_usage(server) == [[0, 0, 0]]


def test_images_generations_route_serves_the_walk(
    captured: capture.CapturedModel, server: Server
) -> None:
    """The route finds the walk through the module's ``api_profile`` and passes the seed: the
    PNG holds the interpreter's image for the same prompt and seed."""
    from fastapi.testclient import TestClient

    from walkserve.adapters.registry import profile_for
    from walkserve.api import media
    from walkserve.api.app import create_app

    profile = profile_for(FACTORY)
    assert profile.image is not None and profile.image.seed_input == "seed"
    ids = profile.image.encode("a red square")
    want = captured.run({"input_ids": torch.tensor([ids]), "seed": torch.tensor([5])}, "generate")
    client = TestClient(create_app(server, profile))
    body = {"model": FACTORY, "prompt": "a red square", "size": "64x64", "seed": 5}
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    # the worker's float pixels differ from this process's in the last bits (its torch threads
    # differ, so do its reductions)
    assert_pixels_match(_pixels(png), _pixels(media.png(want["image"][0])))
    bad = client.post("/v1/images/generations", json={**body, "size": "16x16"})
    assert bad.status_code == 400 and "64x64" in bad.json()["error"]["message"]
    assert pool_usage(server) == [[0, 0, 0]]
