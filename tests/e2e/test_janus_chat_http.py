"""Janus image understanding over HTTP with the official ``openai`` client: ``walkserve serve
tiny-janus`` answers a chat message with text and an ``image_url`` data URL with the tokens
upstream ``JanusForConditionalGeneration.generate()`` (text mode, greedy) gives on the inputs
upstream's image processor and ``<image_placeholder>`` expansion make of the same image and
prompt; two images in one message and a text-only chat likewise; a fifth image is a 400
naming the limit; and
``/v1/images/generations`` still serves the same model. A Janus checkpoint directory
(``janus.checkpoint.save_tiny``: weights, tokenizer, ``JanusProcessor`` with a chat template)
answers the same way against what its own processor makes of the messages and images
(``apply_chat_template``, then the processor)."""

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

from walkserve.adapters import janus  # noqa: E402
from walkserve.adapters.janus.checkpoint import save_tiny  # noqa: E402
from walkserve.adapters.tokenizer import ByteTokenizer  # noqa: E402

MODEL = "tiny-janus"
MAX_TOKENS = 8
TOK = ByteTokenizer(janus.TINY_IDS.boi - 1)


@pytest.fixture(scope="module")
def client(walkserve_serve: Any) -> Iterator[Any]:
    with walkserve_serve(MODEL) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def png(seed: int) -> tuple[dict[str, Any], Image.Image]:
    pixels = np.random.RandomState(seed).randint(0, 256, (20, 30, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    out = io.BytesIO()
    image.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}, image


def upstream(ids: list[int], images: list[Image.Image]) -> list[int]:
    """Upstream ``generate()``'s greedy reply, cut at EOS as the server cuts it."""
    from transformers import JanusImageProcessorPil

    model = janus.tiny_janus(0)
    prompt = torch.tensor([ids])
    extra = {}
    if images:
        processor = JanusImageProcessorPil(size={"height": 64, "width": 64})
        extra["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            **extra,
        )
    tokens = [int(t) for t in out[0, prompt.shape[1] :]]
    return tokens[: tokens.index(janus.TINY_EOS)] if janus.TINY_EOS in tokens else tokens


def chat(client: Any, content: Any, model: str = MODEL) -> list[int]:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    )
    return list(reply.choices[0].token_ids)


def test_chat_with_an_image_equals_upstream_generate(client: Any) -> None:
    part, image = png(1)
    got = chat(client, [{"type": "text", "text": "what is it?"}, part])
    n = (janus.TINY.image_size // 16) ** 2
    image_ids = [janus.TINY_IDS.boi, *[janus.TINY_IMAGE_TOKEN] * n, janus.TINY_EOI]
    ids = [*TOK.encode("user: what is it?"), *image_ids, *TOK.encode("\nassistant:")]
    assert got == upstream(ids, [image])
    assert got  # a reply, not an empty answer


def test_text_only_chat_equals_upstream_generate(client: Any) -> None:
    got = chat(client, "hello there")
    assert got == upstream(TOK.encode("user: hello there\nassistant:"), [])


def test_two_images_in_one_message_equal_upstream_generate(client: Any) -> None:
    """Upstream's model takes several images in one prompt (their features scattered into
    the placeholders in order): the images of two parts, in order."""
    (first, a), (second, b) = png(1), png(2)
    got = chat(client, [first, {"type": "text", "text": " and "}, second])
    n = (janus.TINY.image_size // 16) ** 2
    image_ids = [janus.TINY_IDS.boi, *[janus.TINY_IMAGE_TOKEN] * n, janus.TINY_EOI]
    ids = [*TOK.encode("user: "), *image_ids, *TOK.encode(" and "), *image_ids]
    assert got == upstream([*ids, *TOK.encode("\nassistant:")], [a, b])
    assert got != chat(client, [second, {"type": "text", "text": " and "}, first])  # order


def test_too_many_images_are_refused_naming_the_limit(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="at most 4 media part"):
        chat(client, [png(i)[0] for i in range(5)])


def test_image_generation_still_served(client: Any) -> None:
    out = client.images.generate(model=MODEL, prompt="a cat", size="64x64")
    assert out.data[0].b64_json


@pytest.fixture(scope="module")
def checkpoint(walkserve_serve: Any, tmp_path_factory: Any) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("janus")
    model = save_tiny(str(path))
    with walkserve_serve(str(path), "--served-model-name", DIR_MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        yield path, model, client


DIR_MODEL = "janus-dir"


def processor_reference(path: Any, model: Any, content: list[Any], images: list[Any]) -> list[int]:
    """Upstream: the checkpoint's processor on the HF messages, greedy ``generate()`` cut at
    EOS as the server cuts it."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    assert inputs["input_ids"][0, 0] == processor.tokenizer.bos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    tokens = [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]
    return tokens[: tokens.index(janus.TINY_EOS)] if janus.TINY_EOS in tokens else tokens


def test_checkpoint_directory_chat_equals_upstream_generate(checkpoint: Any) -> None:
    path, model, client = checkpoint
    (part, a), (other, b) = png(1), png(2)
    image, ask = {"type": "image"}, {"type": "text", "text": "What is it?"}
    got = chat(client, [part, ask], DIR_MODEL)
    assert got and got == processor_reference(path, model, [image, ask], [a])
    reply = client.chat.completions.create(
        model=DIR_MODEL, messages=[{"role": "user", "content": [part, ask]}], max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].message.content == "".join(
        chr(t) for t in got if 32 <= t < 127 or t == 10
    )  # the character tokenizer's decoding

    two = [part, {"type": "text", "text": "and"}, other]
    hf_two = [image, {"type": "text", "text": "and"}, image]
    assert chat(client, two, DIR_MODEL) == processor_reference(path, model, hf_two, [a, b])
    hello = [{"type": "text", "text": "Hello"}]
    assert chat(client, "Hello", DIR_MODEL) == processor_reference(path, model, hello, [])
