"""Vision-language models over HTTP with the official ``openai`` client: ``walkserve serve DIR``
of tiny Qwen2-VL, Qwen2.5-VL and LLaVA checkpoints (``adapters.vlm.tiny``, written with
``save_pretrained``). A chat message with an ``image_url`` data URL is answered with the tokens
upstream ``generate(do_sample=False)`` gives on the processor's inputs for the same image and
prompt; the same request again gives the same tokens and hits the vision tower's encoder cache
and the prefix pages through the image (``/metrics``: ``mm_cache_hits_total``,
``prefix_cache_hits_total``); two images in one message, and a text-only chat, equal
``generate()`` too."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402

from walkserve.adapters.vlm import tiny  # noqa: E402
from walkserve.api.metrics import read_metric  # noqa: E402

PAGE = 4
MAX_TOKENS = 8
MODEL = "vlm"


@pytest.fixture(scope="module", params=tiny.KINDS)
def served(request: Any, walkserve_serve: Any, tmp_path_factory: Any) -> Iterator[Any]:
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    upstream = tiny.save_tiny(kind, path)
    args = (str(path), "--served-model-name", MODEL, "--kv-page-size", str(PAGE))
    with walkserve_serve(*args) as server:
        yield kind, path, upstream, server


def png(seed: int, size: tuple[int, int]) -> tuple[dict[str, Any], Image.Image]:
    pixels = np.random.RandomState(seed).rand(size[1], size[0], 3) * 255
    image = Image.fromarray(pixels.astype(np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}, image


def generate(model: Any, inputs: dict[str, Any]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tiny.EOS,
            pad_token_id=0,
        )  # fmt: skip
    tokens = [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]
    return tokens[: tokens.index(tiny.EOS)] if tiny.EOS in tokens else tokens


def chat(client: Any, content: Any) -> tuple[list[int], int]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    )
    return list(reply.choices[0].model_dump()["token_ids"]), reply.usage.prompt_tokens


def metric(server: Any, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return read_metric(text, f"walkserve:{name}", **labels) or 0.0


def test_vlm_chat_equals_generate_and_hits_the_encoder_cache_and_prefix_pages(
    served: Any,
) -> None:
    kind, path, upstream, server = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    part, image = png(1, (30, 20))
    hf = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    ref = tiny.reference_inputs(kind, path, [{"role": "user", "content": hf}], [image])
    want = generate(upstream, ref)
    assert want
    content = [part, {"type": "text", "text": "What is it?"}]
    assert chat(client, content) == (want, ref["input_ids"].shape[1])
    assert metric(server, "mm_cache_hits_total", component="vision") == 0
    assert chat(client, content) == (want, ref["input_ids"].shape[1])  # the same tokens
    assert metric(server, "mm_cache_queries_total", component="vision") == 2
    assert metric(server, "mm_cache_hits_total", component="vision") == 1
    pages = (ref["input_ids"].shape[1] - 1) // PAGE  # every full page, the image's included
    deadline = time.monotonic() + 10  # the pools' figures come with the workers' heartbeats
    while metric(server, "prefix_cache_hits_total", component="lm") < pages:
        assert time.monotonic() < deadline, "no prefix pages hit"
        time.sleep(0.2)
    assert metric(server, "prefix_cache_hits_total", component="lm") == pages

    other, second = png(2, (20, 36))
    hf_two = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    two = tiny.reference_inputs(kind, path, [{"role": "user", "content": hf_two}], [image, second])
    content_two = [part, {"type": "text", "text": "and"}, other]
    assert chat(client, content_two) == (generate(upstream, two), two["input_ids"].shape[1])
    assert metric(server, "mm_cache_hits_total", component="vision") == 2  # the first image

    text = tiny.reference_inputs(kind, path, [{"role": "user", "content": "Hello"}], [])
    assert chat(client, "Hello") == (generate(upstream, text), text["input_ids"].shape[1])

    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content

    many = [part] * 9  # the profile's limit is 8 images
    with pytest.raises(openai.BadRequestError, match=r"at most 8 media part") as info:
        chat(client, many)
    assert info.value.body["param"] == "messages[0].content[8]"
