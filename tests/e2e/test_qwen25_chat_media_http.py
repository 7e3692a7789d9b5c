"""Media parts in chat messages over HTTP with the official ``openai`` client, to the tiny
Qwen2.5-Omni served by ``walkserve serve``: images (data URLs) and audio clips (input_audio)
alone and together in one message, each reply equal to upstream ``thinker.generate()``
(greedy) on the inputs upstream's ``Qwen2_5OmniProcessor`` makes of the same media (decoded
as the server decodes them: Pillow, PyAV); audio out with media equals upstream ``generate()``'s (pcm16); clips
past the processor's 30 s are 400s naming the field (videos: ``test_qwen25_video_http``). ``/v1/audio/transcriptions``
of a clip equals upstream's greedy reply to the transcription turn with that clip (json,
text, streamed)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")

from walkserve.adapters import qwen25_omni as q  # noqa: E402
from walkserve.adapters.omni_transcribe import instruction  # noqa: E402
from walkserve.api import audiocodec  # noqa: E402

MODEL = "walkserve.adapters.qwen25_omni:tiny_audible"  # conftest's qwen25 serves it
IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
CLIP = torch.sin(torch.arange(32000) / 11.0) * 0.3  # 2 s at 16 kHz


@pytest.fixture(scope="module")
def client(qwen25: Any) -> Any:
    return openai.OpenAI(base_url=f"{qwen25.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """The tiny model's upstream thinker (the server's weights: the same seed) and
    upstream's processor for the tiny config."""
    return q.tiny_audible()[0], q.tiny_processor()


def picture(fmt: str, size: tuple[int, int], seed: int = 5) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(out, format=fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(data)}"}}


def audio_part(clip: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(clip), "format": fmt}}


def expected(
    reference: tuple[Any, Any], user: str, images: list[bytes], clips: list[bytes], n: int
) -> tuple[str, int]:
    """(the reply's text, the prompt's tokens) of upstream ``thinker.generate()`` on the
    processor's inputs: the ChatML turn ``user`` (media marks where the parts are), the images
    decoded by Pillow, the clips by PyAV at 16 kHz, as the server decodes them."""
    from PIL import Image

    walks, processor = reference
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(
        text=[text],
        images=[np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in images] or None,
        audio=[audiocodec.decode(c, 16000, 30.0).numpy() for c in clips] or None,
        return_tensors="pt",
    )
    ids = inputs["input_ids"]
    out = walks.upstream.thinker.generate(
        **inputs, max_new_tokens=n, eos_token_id=walks.eos, do_sample=False
    )[0, ids.shape[1] :].tolist()
    out = out[: out.index(walks.eos)] if walks.eos in out else out
    return bytes(t for t in out if t < 238).decode("utf-8", errors="replace"), ids.shape[1]


def test_images_and_clips_in_one_message_equal_upstream_generate(
    client: Any, reference: Any
) -> None:
    images = [picture("PNG", (30, 20)), picture("JPEG", (40, 24), seed=6)]
    clips = [
        audiocodec.encode(CLIP[:12000], "wav", 16000),
        audiocodec.encode(CLIP[3000:8000] * 0.5, "flac", 16000),
    ]
    want, prompt = expected(reference, f"Hi{IMAGE}{AUDIO}and{IMAGE}{AUDIO}", images, clips, 8)
    assert want
    content = [{"type": "text", "text": "Hi"}, image_part(images[0]), audio_part(clips[0], "wav")]
    content += [{"type": "text", "text": "and"}, image_part(images[1], "image/jpeg")]
    content.append(audio_part(clips[1], "flac"))
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens == prompt
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_an_image_alone_and_clips_alone_equal_upstream_generate(
    client: Any, reference: Any
) -> None:
    answers = set()
    for data, mime in [
        (picture("PNG", (30, 20)), "image/png"),
        (picture("WEBP", (200, 90)), "image/webp"),
    ]:
        want, _ = expected(reference, f"{IMAGE}Describe.", [data], [], 8)
        content = [image_part(data, mime), {"type": "text", "text": "Describe."}]
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8
        )
        assert reply.choices[0].message.content == want, mime
        answers.add(want)
    assert len(answers) > 1  # the image is read
    clips = [audiocodec.encode(CLIP[:8000], "wav", 16000), audiocodec.encode(CLIP, "mp3", 16000)]
    want, _ = expected(reference, f"{AUDIO}x{AUDIO}", [], clips, 6)
    content = [audio_part(clips[0], "wav"), {"type": "text", "text": "x"}]
    content.append(audio_part(clips[1], "mp3"))
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6
    )
    assert reply.choices[0].message.content == want


def test_audio_out_with_media_equals_upstream_generate(client: Any, reference: Any) -> None:
    """Audio out with an image or a clip (``speak_image`` / ``speak_audio``): the transcript
    and the pcm16 samples are upstream ``generate()``'s (greedy, seed 0; its talker spared
    ``pixel_values``: ``upstream_speech``) on the processor's inputs, within one LSB."""
    from PIL import Image

    from walkserve.adapters import omni_http

    walks, processor = reference
    png = picture("PNG", (30, 20))
    clip = audiocodec.encode(CLIP[:8000], "wav", 16000)
    for part, tag, images, clips, walk in (
        (image_part(png), IMAGE, [png], [], "speak_image"),
        (audio_part(clip, "wav"), AUDIO, [], [clip], "speak_audio"),
    ):
        want, _ = expected(reference, f"Hi{tag}", images, clips, 4)
        text = f"<|im_start|>user\nHi{tag}<|im_end|>\n<|im_start|>assistant\n"
        r = dict(
            processor(
                text=[text],
                images=[np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in images]
                or None,
                audio=[audiocodec.decode(c, 16000, 30.0).numpy() for c in clips] or None,
                return_tensors="pt",
            )
        )
        r |= {"max_new_tokens": 4, "max_audio_tokens": omni_http.TINY_LIMITS.chat_audio_tokens}
        _, _, waveform = q.upstream_speech(walks, r, seed=0, walk=walk)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}],
            modalities=["text", "audio"],
            audio={"voice": "Chelsie", "format": "pcm16"},
            max_tokens=4,
        )
        audio = reply.choices[0].message.audio
        assert audio.transcript == want, tag
        got = torch.frombuffer(bytearray(base64.b64decode(audio.data)), dtype=torch.int16)
        pcm = (waveform.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int32)
        assert got.shape == pcm.shape and pcm.abs().max() > 1000, tag  # audible
        assert (got.to(torch.int32) - pcm).abs().max() <= 1, tag  # rounding may flip one LSB


def test_refusals_name_the_field(client: Any) -> None:
    """(Videos, and their refusals: ``test_qwen25_video_http``.)"""
    long = audiocodec.encode(torch.sin(torch.arange(16000 * 31) / 11.0) * 0.3, "flac", 16000)
    with pytest.raises(openai.BadRequestError, match=r"longer than the limit of 30 s") as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [audio_part(long, "flac")]}],
            max_tokens=2,
        )
    assert e.value.body["param"] == "messages[0].content[0].input_audio.data"


def test_transcription_equals_upstream_generate(client: Any, reference: Any) -> None:
    """The reply to ``AUDIO`` + the instruction (language, prompt in it) at the route's limit
    (the tiny profile's 64 tokens)."""
    clip = audiocodec.encode(CLIP[:24000], "flac", 16000)
    want, prompt = expected(reference, AUDIO + instruction(None, "hello"), [], [clip], 64)
    assert want
    got = client.audio.transcriptions.create(
        model=MODEL, file=("clip.flac", clip, "audio/flac"), prompt="hello"
    )
    assert got.text == want and got.usage.input_tokens == prompt
    text = client.audio.transcriptions.create(
        model=MODEL, file=("clip.flac", clip), prompt="hello", response_format="text"
    )
    assert text == want
    german, _ = expected(reference, AUDIO + instruction("de", None), [], [clip], 64)
    assert german != want  # the instruction is read
    stream = client.audio.transcriptions.create(
        model=MODEL, file=("clip.flac", clip), language="de", stream=True
    )
    *deltas, done = list(stream)
    assert {e.type for e in deltas} == {"transcript.text.delta"} and len(deltas) > 1
    assert "".join(e.delta for e in deltas) == german and done.text == german
    long = audiocodec.encode(torch.zeros(16000 * 31), "flac", 16000)
    with pytest.raises(openai.BadRequestError, match=r"longer than the limit of 30 s"):
        client.audio.transcriptions.create(model=MODEL, file=("long.flac", long))
