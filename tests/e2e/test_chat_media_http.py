"""Media parts in chat messages over HTTP with the official ``openai`` client, to the tiny
Qwen3-Omni (the session's ``omni`` server, shared with ``test_speech_http``): audio clips and
images (data URLs) alone and together in one message, and a video, checked against the walks
run by the reference interpreter, or upstream ``thinker.generate()``, on the inputs upstream's
processor makes of the same media; refusals name the field."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")

from omni_reference import (  # noqa: E402 (tests/e2e, on pytest's path)
    CLIP,
    CONFIG,
    LIMITS,
    OMNI,
    SPEAKERS,
    assert_pcm_close,
    clip_features,
    clips_features,
    ref_pcm,
    transcript,
)

from walkserve.adapters import qwen3_omni  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.api import audiocodec  # noqa: E402


@pytest.fixture(scope="module")
def client(omni: Any) -> Any:
    return openai.OpenAI(base_url=f"{omni.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref() -> Any:
    return capture_model(OMNI)


@pytest.fixture(scope="module")
def eos(tiny_walks: Any) -> int:
    return int(tiny_walks.eos)


@pytest.fixture(scope="module")
def tiny_walks() -> Any:
    return qwen3_omni.tiny()[0]


def image_features(data: bytes) -> tuple[dict[str, torch.Tensor], list[int]]:
    """An image's walk inputs as upstream's processor makes them (Pillow's RGB image through
    the Qwen2-VL image processor of the tiny vision tower's sizes, at most 64 x 64 pixels) and
    its placeholders ``<|vision_start|> <|image_pad|> x t*h*w/4 <|vision_end|>``."""
    import io

    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    vision = CONFIG.thinker_config.vision_config
    processor = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        size={"shortest_edge": 64, "longest_edge": 64 * 64},
    )
    out = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    thinker = CONFIG.thinker_config
    count = int(out["image_grid_thw"].prod()) // vision.spatial_merge_size**2
    placeholders = [thinker.vision_start_token_id, *[thinker.image_token_id] * count]
    inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return inputs, [*placeholders, thinker.vision_end_token_id]


def picture(fmt: str, size: tuple[int, int] = (30, 20)) -> bytes:
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(5)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(out, format=fmt)
    return out.getvalue()


def solid_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def audio_part(clip: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(clip), "format": fmt}}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def upstream_reply(walks: Any, ids: torch.Tensor, media: dict[str, Any], n: int) -> str:
    """Upstream ``thinker.generate()`` (greedy) on the prompt ``ids`` and ``media``: the reply's
    text, up to EOS (the tiny tokenizer's bytes; ids >= 238 are specials, dropped)."""
    out = walks.upstream.thinker.generate(
        ids, **media, max_new_tokens=n, eos_token_id=walks.eos, do_sample=False
    )[0, ids.shape[1] :].tolist()
    out = out[: out.index(walks.eos)] if walks.eos in out else out
    return bytes(t for t in out if t < 238).decode("utf-8", errors="replace")


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    url = f"data:{mime};base64,{b64(data)}"
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_audio_part_equals_the_chat_audio_walk(client: Any, ref: Any, eos: int) -> None:
    clip = audiocodec.encode(CLIP[:12000], "wav", 16000)  # 0.75 s
    features, placeholders = clip_features(clip)
    user = [10, *b"Hi", *placeholders, *b"what?"]  # the part where it is, text joined to it
    inputs = {"input_ids": qwen3_omni.chat_prompt(CONFIG, user, 10), **features}
    want = transcript(dict(ref.run({**inputs, "max_new_tokens": 9}, walk="chat_audio")), eos, 9)
    assert want
    content = [{"type": "text", "text": "Hi"}, audio_part(clip, "wav")]
    content.append({"type": "text", "text": "what?"})
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(model=OMNI, messages=messages, max_tokens=9)
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    stream = client.chat.completions.create(
        model=OMNI, messages=messages, max_tokens=9, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_chat_image_part_equals_the_chat_image_walk(client: Any, ref: Any, eos: int) -> None:
    answers = set()
    kinds = [("PNG", "image/png", (30, 20)), ("JPEG", "image/jpeg", (30, 20))]
    kinds.append(("WEBP", "image/webp", (200, 90)))  # resized by the processor to <= 64 x 64
    for fmt, mime, size in kinds:
        data = picture(fmt, size)
        features, placeholders = image_features(data)
        user = [10, *placeholders, *b"Describe."]
        inputs = {"input_ids": qwen3_omni.chat_prompt(CONFIG, user, 10), **features}
        run = dict(ref.run({**inputs, "max_new_tokens": 8}, walk="chat_image"))
        want = transcript(run, eos, 8)
        content = [image_part(data, mime), {"type": "text", "text": "Describe."}]
        reply = client.chat.completions.create(
            model=OMNI, messages=[{"role": "user", "content": content}], max_tokens=8
        )
        assert reply.choices[0].message.content == want, fmt
        answers.add(want)
    assert len(answers) > 1  # the image is read: the lossy formats' pixels change the reply


def test_a_video_part_equals_upstream_thinker_generate(
    client: Any, tiny_walks: Any, eos: int
) -> None:
    """A video (mp4, 2 s at 3 fps) over HTTP: the reply equals upstream ``thinker.generate()``
    (greedy) on the profile's inputs for its frames (read at the processor's 1 fps; checked
    against upstream's processor in ``tests/unit/test_qwen3_omni_video.py``)."""
    from walkserve.api import videocodec

    task = qwen3_omni.tiny_profile("m").chat_media
    assert task is not None and task.video is not None
    g = torch.Generator().manual_seed(4)
    frames = torch.randint(0, 256, (6, 24, 32, 3), generator=g, dtype=torch.uint8)
    data = videocodec.encode(frames, 3)
    decoded = videocodec.decode(data, task.video_limits, task.video_frames)
    inputs, [ids] = task.video.inputs([decoded])
    prompt = qwen3_omni.chat_prompt(CONFIG, [10, *b"Hi", *ids], 10)
    want = upstream_reply(tiny_walks, prompt, inputs, 8)
    assert want
    url = f"data:video/mp4;base64,{b64(data)}"
    content = [{"type": "text", "text": "Hi"}, {"type": "video_url", "video_url": {"url": url}}]
    reply = client.chat.completions.create(
        model=OMNI, messages=[{"role": "user", "content": content}], max_tokens=8
    )
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == (
        want,
        prompt.shape[1],
    )


def test_chat_media_with_audio_out_runs_speak_audio(client: Any, ref: Any, eos: int) -> None:
    clip = audiocodec.encode(CLIP[:8000], "flac", 16000)
    features, placeholders = clip_features(clip)
    inputs = {
        "input_ids": qwen3_omni.chat_prompt(CONFIG, [10, *placeholders], 10),
        **features,
        "max_new_tokens": 5,
        "max_audio_tokens": LIMITS.chat_audio_tokens,
        "speaker_id": SPEAKERS["ethan"],
    }
    want = dict(ref.run(inputs, walk="speak_audio"))
    reply = client.chat.completions.create(
        model=OMNI,
        messages=[{"role": "user", "content": [audio_part(clip, "flac")]}],
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        max_tokens=5,
    )
    message = reply.choices[0].message
    assert message.audio.transcript == transcript(want, eos, 5)
    assert_pcm_close(base64.b64decode(message.audio.data)[44:], ref_pcm(want["waveform"]))


def test_chat_media_refusals_name_the_field(client: Any) -> None:
    png = picture("PNG")
    cases = [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            r"remote image URLs are not enabled on this server",
            "messages[0].content[0].image_url.url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "/etc/cat.png"}},
            r"other than data URLs",
            "messages[0].content[0].image_url.url",
        ),
        (
            image_part(png, "image/gif"),
            r"'image/gif'",
            "messages[0].content[0].image_url.url",
        ),
        (
            image_part(b"not an image"),
            r"not a PNG, JPEG or WebP",
            "messages[0].content[0].image_url.url",
        ),
        (
            image_part(solid_png(4097, 4096)),  # the server's max_image_pixels, 4096 x 4096
            r"limit is 16777216 pixels",
            "messages[0].content[0].image_url.url",
        ),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            r"not a video that can be read",
            "messages[0].content[0].video_url.url",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}},
            r"is not base64",
            "messages[0].content[0].input_audio.data",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}},
            r"'ogg' is not supported",
            "messages[0].content[0].input_audio.format",
        ),
    ]
    for part, match, param in cases:
        with pytest.raises(openai.BadRequestError, match=match) as info:
            client.chat.completions.create(
                model=OMNI, messages=[{"role": "user", "content": [part]}], max_tokens=2
            )
        assert info.value.body["param"] == param, part
    two = [image_part(png)] * 5
    with pytest.raises(openai.BadRequestError, match=r"at most 4 media part") as info:
        client.chat.completions.create(
            model=OMNI, messages=[{"role": "user", "content": two}], max_tokens=2
        )
    assert info.value.body["param"] == "messages[0].content[4]"
    assistant = {"role": "assistant", "content": [image_part(png)]}
    with pytest.raises(openai.BadRequestError, match=r"go in user messages"):
        client.chat.completions.create(
            model=OMNI, messages=[{"role": "user", "content": "x"}, assistant], max_tokens=2
        )


def test_images_and_clips_in_one_message_equal_upstream_generate(
    client: Any, tiny_walks: Any, eos: int
) -> None:
    """Two images and two audio clips in one message (data URLs and input_audio parts): the
    reply equals upstream ``thinker.generate()`` on the processor's inputs for the same media
    (the images through the image processor one by one, the clips through the feature
    extractor at once)."""
    images = [picture("PNG", (30, 20)), picture("JPEG", (40, 24))]
    clips = [
        audiocodec.encode(CLIP[:12000], "wav", 16000),
        audiocodec.encode(CLIP[3000:8000] * 0.5, "flac", 16000),
    ]
    pictures = [image_features(data) for data in images]
    audio, clip_ids = clips_features(clips)
    user = [10, *b"Hi", *pictures[0][1], *clip_ids[0], *b"and", *pictures[1][1], *clip_ids[1]]
    ids = qwen3_omni.chat_prompt(CONFIG, user, 10)
    pixels = torch.cat([p[0]["pixel_values"] for p in pictures])
    grids = torch.cat([p[0]["image_grid_thw"] for p in pictures])
    media = {**audio, "pixel_values": pixels, "image_grid_thw": grids}
    text = upstream_reply(tiny_walks, ids, media, 8)
    assert text
    content = [{"type": "text", "text": "Hi"}, image_part(images[0]), audio_part(clips[0], "wav")]
    content += [{"type": "text", "text": "and"}, image_part(images[1], "image/jpeg")]
    content += [audio_part(clips[1], "flac")]
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(model=OMNI, messages=messages, max_tokens=8)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == ids.shape[1]
    with pytest.raises(openai.BadRequestError, match=r"audio and images in one request") as info:
        client.chat.completions.create(
            model=OMNI,
            messages=messages,
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"},
            max_tokens=4,
        )
    assert info.value.body["param"] == "messages"
