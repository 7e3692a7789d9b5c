"""Janus image generation from a checkpoint directory over HTTP with the official ``openai``
client: ``walkserve serve DIR`` on a tiny checkpoint written by ``save_pretrained``
(``janus.checkpoint.save_tiny``, its generation config setting guidance 3 and top-k 20)
answers ``client.images.generate`` with the pixels upstream makes for the same prompt and
seed: the checkpoint's ``JanusProcessor`` (chat template, ``generation_mode="image"``),
``JanusForConditionalGeneration.generate(generation_mode="image", do_sample=True)`` after
``torch.manual_seed(seed)``, ``decode_image_tokens`` and the processor's ``postprocess``
(``assert_pixels_match``: the worker's float pixels, made with other torch threads, may put a
rare value one level off). A
request without a seed gets a random one, said in the answer, whose image is upstream's for
it; JPEG comes out as asked; ``/v1/models`` lists the one size; unsupported fields are 400s
naming them."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402

from walkserve.adapters.janus.checkpoint import save_tiny  # noqa: E402
from walkserve.testing import assert_pixels_match  # noqa: E402

MODEL = "janus-images"
PROMPT = "a red cat on a mat"


@pytest.fixture(scope="module")
def served(walkserve_serve: Any, tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    path = str(tmp_path_factory.mktemp("janus-images"))
    save_tiny(path, guidance_scale=3.0, do_sample=True, top_k=20)
    with walkserve_serve(path, "--served-model-name", MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        yield path, client


def upstream(path: str, prompt: str, seed: int) -> np.ndarray:
    """[H, W, 3] uint8: upstream's image for ``prompt`` and ``seed`` from the checkpoint's own
    processor and generation config. ``postprocess`` gets the decoded image channels first:
    the Pillow backend's unnormalize reads channels first (channels last raises here)."""
    from transformers import AutoProcessor, JanusForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    model = JanusForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, generation_mode="image", return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        tokens = model.generate(**inputs, generation_mode="image", do_sample=True)
        decoded = model.decode_image_tokens(tokens)  # [1, H, W, 3]
    out = processor.postprocess(
        list(decoded.permute(0, 3, 1, 2).float()), return_tensors="PIL.Image.Image"
    )
    return np.asarray(out["pixel_values"][0])


def pixels(b64: str, fmt: str = "PNG") -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        assert im.format == fmt and im.mode == "RGB"
        return np.asarray(im)


def test_image_pixels_equal_upstream_generate_decode_postprocess(served: Any) -> None:
    path, client = served
    out = client.images.generate(model=MODEL, prompt=PROMPT, size="64x64", extra_body={"seed": 7})
    got = pixels(out.data[0].b64_json)
    want = upstream(path, PROMPT, 7)
    assert got.shape == (64, 64, 3) and len(np.unique(want)) > 16  # an image, not a flat field
    assert_pixels_match(got, want)  # the worker's float pixels: other torch threads
    assert out.data[0].model_extra["seed"] == 7 and out.size == "64x64"
    other = client.images.generate(model=MODEL, prompt=PROMPT, extra_body={"seed": 8})
    assert not np.array_equal(pixels(other.data[0].b64_json), got)  # the seed counts


def test_a_request_without_seed_gets_a_random_one_it_can_repeat(served: Any) -> None:
    path, client = served
    out = client.images.generate(model=MODEL, prompt="waves")
    seed = out.data[0].model_extra["seed"]
    assert isinstance(seed, int)
    assert_pixels_match(pixels(out.data[0].b64_json), upstream(path, "waves", seed))
    jpeg = client.images.generate(
        model=MODEL, prompt="waves", output_format="jpeg", extra_body={"seed": seed}
    )
    assert jpeg.output_format == "jpeg"
    assert pixels(jpeg.data[0].b64_json, "JPEG").shape == (64, 64, 3)


def test_models_lists_the_checkpoints_one_size(served: Any) -> None:
    _, client = served
    [model] = client.models.list().data
    assert model.id == MODEL and "image" in model.model_extra["tasks"]
    assert model.model_extra["image_sizes"] == ["64x64"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"size": "32x32"}, "size"),
        ({"style": "vivid"}, "style"),
        ({"n": 2}, "n"),
        ({"extra_body": {"guidance_scale": 2.0}}, "guidance_scale"),
        ({"prompt": "a <image_placeholder> here"}, "image_placeholder"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(
    served: Any, fields: dict[str, Any], named: str
) -> None:
    _, client = served
    with pytest.raises(openai.BadRequestError, match=named):
        client.images.generate(**{"model": MODEL, "prompt": PROMPT, **fields})
