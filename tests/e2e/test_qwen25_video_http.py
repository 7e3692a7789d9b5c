"""Video parts (``video_url`` data URLs) in chat messages over HTTP with the official ``openai``
client, to the tiny Qwen2.5-Omni served by ``walkserve serve``: a message with small videos
(frames encoded by PyAV here, mp4 and webm) is answered as upstream
``thinker.generate()`` (greedy) answers the inputs upstream's ``Qwen2_5OmniProcessor`` makes
of the same frames (decoded and picked at 2 frames a second as the server does; its video
processor is torch's twin of upstream's where torchvision does not import, checked against
upstream in ``tests/unit/test_omni_video.py``): ``pixel_values_videos``, ``video_grid_thw``,
``video_second_per_grid`` and the prompt's ids. A corrupt video, one past the tiny profile's
limits, a video with an image, and audio out with a video are 400s naming the field."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")

from walkserve.adapters import qwen25_omni as q  # noqa: E402
from walkserve.api import videocodec  # noqa: E402

MODEL = "walkserve.adapters.qwen25_omni:tiny_audible"  # conftest's qwen25 serves it
VIDEO = "<|vision_bos|><|VIDEO|><|vision_eos|>"


@pytest.fixture(scope="module")
def client(qwen25: Any) -> Any:
    """The tiny Qwen2.5-Omni server (``conftest.qwen25``: shared with its chat-media module)."""
    return openai.OpenAI(base_url=f"{qwen25.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any, Any]:
    """The tiny model's upstream thinker (the server's weights: the same seed), upstream's
    processor for the tiny config, and the served profile's chat-media task (its limits and
    frame picker)."""
    return q.tiny_audible()[0], q.tiny_processor(), q.tiny_profile("m").chat_media


def clip(frames: int, fps: int, size: tuple[int, int], fmt: str, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (frames, size[1], size[0], 3), generator=g, dtype=torch.uint8)
    codec = "libvpx" if fmt == "webm" else "mpeg4"
    return videocodec.encode(pixels, fps, fmt, codec)


def video_part(data: bytes, mime: str = "video/mp4") -> dict[str, Any]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "video_url", "video_url": {"url": url}}


def expected(reference: Any, user: str, videos: list[bytes], n: int) -> tuple[str, int]:
    """(the reply's text, the prompt's tokens) of upstream ``thinker.generate()`` on the
    processor's inputs for the ChatML turn ``user`` and the videos' picked frames."""
    walks, processor, task = reference
    frames = [videocodec.decode(v, task.video_limits, task.video_frames).frames for v in videos]
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=[text], videos=[f.numpy() for f in frames], return_tensors="pt")
    assert inputs["video_second_per_grid"].tolist() == [1.0] * len(videos)
    ids = inputs["input_ids"]
    out = walks.upstream.thinker.generate(
        **inputs, max_new_tokens=n, eos_token_id=walks.eos, do_sample=False
    )[0, ids.shape[1] :].tolist()
    out = out[: out.index(walks.eos)] if walks.eos in out else out
    return bytes(t for t in out if t < 238).decode("utf-8", errors="replace"), ids.shape[1]


def test_videos_in_a_message_equal_upstream_generate(client: Any, reference: Any) -> None:
    videos = [clip(6, 3, (32, 24), "mp4"), clip(5, 2, (40, 40), "webm", seed=1)]
    want, prompt = expected(reference, f"Hi{VIDEO}and{VIDEO}", videos, 8)
    swapped, _ = expected(reference, f"Hi{VIDEO}and{VIDEO}", videos[::-1], 8)
    assert want and swapped != want  # the videos are read
    content = [{"type": "text", "text": "Hi"}, video_part(videos[0])]
    content += [{"type": "text", "text": "and"}, video_part(videos[1], "video/webm")]
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == (want, prompt)


def refused(client: Any, content: list[dict[str, Any]], match: str, **kw: Any) -> Any:
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2, **kw
        )
    return e.value.body["param"]


def test_bad_videos_are_400s_naming_the_field(client: Any) -> None:
    where = "messages[0].content[0].video_url.url"
    corrupt = video_part(b"\x00\x00\x00\x18ftypmp42 but nothing more" * 4)
    assert refused(client, [corrupt], "not a video that can be read") == where
    truncated = clip(6, 3, (32, 24), "mp4")
    assert refused(client, [video_part(truncated[:300])], "video") == where
    long = video_part(clip(12, 1, (16, 16), "mp4"))  # 12 s; the tiny profile reads 10 s
    assert refused(client, [long], r"the video is 12 s long; the limit is 10 s") == where
    big = video_part(clip(2, 2, (400, 240), "mp4"))
    assert refused(client, [big], r"the limit is 76800 pixels a frame") == where
    one = video_part(clip(1, 2, (16, 16), "mp4"))
    assert refused(client, [one], "the video has 1 frames; the model reads at least 2") == where
    wrong = {"type": "video_url", "video_url": {"url": "data:image/png;base64,AAAA"}}
    assert refused(client, [wrong], "a data URL of 'image/png'") == where
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    good = video_part(clip(4, 2, (16, 16), "mp4"))
    assert refused(client, [good, image], "reads video parts alone") == "messages"
    param = refused(
        client,
        [good],
        "cannot answer video with audio output",
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"},
    )
    assert param == "messages[0].content[0]"
