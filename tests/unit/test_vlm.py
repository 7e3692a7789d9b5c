"""Vision-language models (``adapters.vlm``): tiny Qwen2-VL, Qwen2.5-VL (its tower's window
attention included) and LLaVA checkpoints written with ``save_pretrained`` and loaded as the
server loads them (``load_vlm``), their LM on the paged pool and their vision tower as its own
component, driven in-process as the walks drive them.
Requests with one image, two images and none share packed forwards and each equals upstream
``generate(do_sample=False)`` on the processor's inputs; the same image again hits the encoder
cache and the prefix pages through the image (counted), a different image at the same place
only the pages before it; the profile's image inputs are the processor's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from PIL import Image

from walkserve.adapters.registry import checkpoint_kind, profile_for
from walkserve.adapters.vlm import load_vlm, tiny
from walkserve.lowering.batched import Deferred

PAGE = 4
N = 8


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(size[1], size[0], 3) * 255
    return Image.fromarray(pixels.astype(np.uint8))


def user(images: int, text: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [*[{"type": "image"}] * images, {"type": "text", "text": text}]}
    ]


def walk_inputs(kind: str, ref: dict[str, Any]) -> dict[str, Any]:
    """The walks' image inputs of a processor's output (LLaVA: the grid the API makes)."""
    if "pixel_values" not in ref:
        return {}
    pixels = ref["pixel_values"]
    if kind == "llava":
        side = pixels.shape[-1] // 7
        return {
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor([[1, side, side]] * len(pixels)),
        }
    return {"pixel_values": pixels, "image_grid_thw": ref["image_grid_thw"]}


def serve(walks: Any, requests: list[dict[str, Any]]) -> list[list[int]]:
    """Greedy, every live request's step in one ``forward_batch`` of the LM; the image
    requests' encoder calls in one ``forward_batch`` of the tower."""
    media = [r for r in requests if "pixel_values" in r]
    encoded = iter(
        walks.vision.forward_batch([((r["pixel_values"], r["image_grid_thw"]), {}) for r in media])
    )
    calls = []
    for r in requests:
        kwargs: dict[str, Any] = {}
        if "pixel_values" in r:
            features, keys = next(encoded)
            kwargs = dict(
                image_features=features, image_keys=keys, image_grid_thw=r["image_grid_thw"]
            )
        calls.append(((r["input_ids"], None, 0), kwargs))
    outs: list[list[int]] = [[] for _ in requests]
    caches: list[Any] = [None] * len(requests)
    live = list(range(len(requests)))
    while live:
        results = walks.lm.forward_batch([calls[i] for i in live])
        assert not any(isinstance(x, Deferred) for x in results)
        for i, (token, cache) in zip(list(live), results):
            outs[i].append(int(token))
            caches[i] = cache
            if int(token) == tiny.EOS or len(outs[i]) == N:
                live.remove(i)
            else:
                calls[i] = ((token, cache, len(outs[i])), {})
    return outs


def generate(model: Any, ref: dict[str, Any]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            **ref, max_new_tokens=N, do_sample=False, eos_token_id=tiny.EOS, pad_token_id=0
        )
    return [int(t) for t in out[0, ref["input_ids"].shape[1] :]]


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_vlm_served_equal_to_generate_with_encoder_and_prefix_caches(
    kind: str, tmp_path: Path
) -> None:
    upstream = tiny.save_tiny(kind, tmp_path)
    assert checkpoint_kind(str(tmp_path)) == "vlm"
    walks, _ = load_vlm(str(tmp_path))
    walks.lm.config_kv = type(walks.lm.config_kv)(pool_tokens=1024, page_size=PAGE)
    a, b = picture(1, (30, 20)), picture(2, (20, 36))
    refs = [
        tiny.reference_inputs(kind, tmp_path, user(1, "What is it?"), [a]),
        tiny.reference_inputs(kind, tmp_path, user(2, "Both?"), [a, b]),
        tiny.reference_inputs(kind, tmp_path, user(0, "Just text"), []),
    ]
    want = [generate(upstream, r) for r in refs]
    assert len({t for w in want for t in w}) >= 8  # varied: the comparison can fail
    requests = [{"input_ids": r["input_ids"], **walk_inputs(kind, r)} for r in refs]
    assert serve(walks, requests) == want
    stats = walks.lm.kv_stats()
    assert stats is not None and stats.prefix_hits == 0
    # a and the two-image request's first image are one image: encoded once
    assert walks.vision.counters() == {"mm_cache_queries": 3, "mm_cache_hits": 1}

    again = serve(walks, [requests[0]])  # the same image and prompt: both caches hit
    assert again == [want[0]]
    assert walks.vision.counters() == {"mm_cache_queries": 4, "mm_cache_hits": 2}
    prompt = refs[0]["input_ids"].shape[1]
    hits = walks.lm.kv_stats().prefix_hits  # type: ignore[union-attr]
    assert hits == (prompt - 1) // PAGE  # every full page, through the image's tokens

    other = tiny.reference_inputs(kind, tmp_path, user(1, "What is it?"), [b])
    got = serve(walks, [{"input_ids": other["input_ids"], **walk_inputs(kind, other)}])
    assert got == [generate(upstream, other)]
    first_image = int((other["input_ids"][0] == walks.family.image_token).nonzero()[0])
    after = walks.lm.kv_stats().prefix_hits  # type: ignore[union-attr]
    assert after - hits == first_image // PAGE  # only the pages before the other image
    assert walks.vision.counters()["mm_cache_hits"] == 3  # b was seen in the two-image request


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_profile_image_inputs_are_the_processors(kind: str, tmp_path: Path) -> None:
    tiny.save_tiny(kind, tmp_path)
    media = profile_for(str(tmp_path)).chat_media
    assert media is not None and media.image is not None and media.max_parts > 1
    assert media.image.walk == "prefill_image"
    image = picture(3, (40, 24))
    ref = tiny.reference_inputs(kind, tmp_path, user(1, ""), [image])
    inputs, [placeholders] = media.image.inputs([torch.from_numpy(np.array(image))])
    assert torch.equal(inputs["pixel_values"], ref["pixel_values"])
    assert inputs.keys() == walk_inputs(kind, ref).keys()
    for key, value in walk_inputs(kind, ref).items():
        assert torch.equal(inputs[key], value), key
    ids = ref["input_ids"][0].tolist()
    start = ids.index(placeholders[0])
    assert ids[start : start + len(placeholders)] == placeholders


def test_qwen2_5_vl_answers_depend_on_the_towers_windows(tmp_path: Path) -> None:
    """The equality above can fail on Qwen2.5-VL's window attention: with every tower block
    attending over the whole image instead, upstream answers differently."""
    upstream = tiny.save_tiny("qwen2.5-vl", tmp_path)
    refs = [
        tiny.reference_inputs(
            "qwen2.5-vl", tmp_path, user(1, "What is it?"), [picture(s, (30, 20))]
        )
        for s in range(10, 14)
    ]
    want = [generate(upstream, r) for r in refs]
    tower = upstream.model.visual
    assert tower.fullatt_block_indexes == [1]  # block 0 windowed
    grid = refs[0]["image_grid_thw"]
    windows = tower.window_size // tower.patch_size // tower.spatial_merge_size
    assert int(grid.prod()) // tower.spatial_merge_size**2 > windows**2  # several windows
    tower.fullatt_block_indexes = [0, 1]
    assert [generate(upstream, r) for r in refs] != want
