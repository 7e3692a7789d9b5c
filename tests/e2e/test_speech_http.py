"""Speech over HTTP with the official ``openai`` client: ``walkserve serve`` of the tiny
Qwen3-Omni (``tiny_audible``: its code2wav's output scaled so that the waveform survives
pcm16); the tiny Orpheus's voices are in ``test_speech_orpheus_http``. Every result is checked against the same walk run by
the reference interpreter with the same inputs, built here with the adapters' own prompt
builders; audio is compared as 16-bit PCM (the relation: equal within one LSB of rounding)."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from walkserve.adapters import omni_http, omni_transcribe, qwen3_omni  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.api import audiocodec, media  # noqa: E402
from walkserve.api.metrics import read_metric  # noqa: E402

OMNI = "walkserve.adapters.qwen3_omni:tiny_audible"
CONFIG = qwen3_omni.tiny_config()
SPEAKERS = CONFIG.talker_config.speaker_id
LIMITS = omni_http.TINY_LIMITS


@pytest.fixture(scope="module")
def omni(walkserve_serve: Any) -> Iterator[Any]:
    with walkserve_serve("--model", OMNI) as server:
        yield server


@pytest.fixture(scope="module")
def client(omni: Any) -> Any:
    return openai.OpenAI(base_url=f"{omni.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref() -> Any:
    return capture_model(OMNI)


def chat_ids(user_text: str) -> torch.Tensor:
    """The ChatML prompt of one user turn, by the adapter's own builder ([1, P])."""
    return qwen3_omni.chat_prompt(CONFIG, list(b"\n" + user_text.encode()), 10)


def pcm(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32)


def ref_pcm(waveform: torch.Tensor) -> torch.Tensor:
    return pcm(media.pcm16(waveform))


def assert_pcm_close(got: bytes, want: torch.Tensor) -> None:
    samples = pcm(got)
    assert samples.shape == want.shape and samples.numel() > 0
    assert want.abs().max() > 1000  # audible: the comparison means something
    assert (samples - want).abs().max().item() <= 1  # float rounding may flip one LSB


def ref_speech(ref: Any, text: str, speaker: str, max_tokens: int) -> dict[str, Any]:
    inputs = {
        "input_ids": chat_ids(omni_http.READ_ALOUD.format(text=text)),
        "max_new_tokens": LIMITS.read_aloud_tokens,
        "max_audio_tokens": max_tokens,
        "speaker_id": SPEAKERS[speaker],
    }
    return dict(ref.run(inputs, walk="speak"))


def transcript(out: dict[str, Any], eos: int, max_tokens: int) -> str:
    """The reply's text: t0 then the streamed tokens, up to (without) EOS, at most
    ``max_tokens``; the tiny tokenizer's bytes (ids >= 238 are specials, dropped)."""
    tokens = [int(out["first_token"]), *out["text_tokens"].reshape(-1).tolist()][:max_tokens]
    tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
    return bytes(t for t in tokens if t < 238).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def eos() -> int:
    return qwen3_omni.tiny()[0].eos


# ---------------------------------------------------------------- /v1/audio/speech


def test_speech_wav_equals_the_reference_per_voice(client: Any, ref: Any) -> None:
    chelsie = client.audio.speech.create(model=OMNI, voice="chelsie", input="Good day").read()
    assert chelsie[:4] == b"RIFF" and struct.unpack("<I", chelsie[24:28])[0] == 24000
    want = ref_speech(ref, "Good day", "chelsie", LIMITS.default_audio_tokens)
    assert_pcm_close(chelsie[44:], ref_pcm(want["waveform"]))
    other = ref_pcm(ref_speech(ref, "Good day", "ethan", LIMITS.default_audio_tokens)["waveform"])
    assert not torch.equal(other, ref_pcm(want["waveform"]))  # the voice changes the audio


def test_speech_stream_equals_the_reference(client: Any, ref: Any) -> None:
    with client.audio.speech.with_streaming_response.create(
        model=OMNI,
        voice="ethan",
        input="Streamed",
        response_format="pcm",
        extra_body={"stream": True, "max_tokens": 24},
    ) as response:
        chunks = [c for c in response.iter_bytes() if c]
    assert_pcm_close(
        b"".join(chunks), ref_pcm(ref_speech(ref, "Streamed", "ethan", 24)["waveform"])
    )


def test_unknown_voice_is_400_naming_the_voices(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'alloy'.*chelsie.*ethan"):
        client.audio.speech.create(model=OMNI, voice="alloy", input="hi").read()


# ---------------------------------------------------------------- chat


def ref_chat_audio(ref: Any, text: str, speaker: str, max_tokens: int) -> dict[str, Any]:
    inputs = {
        "input_ids": chat_ids(text),
        "max_new_tokens": max_tokens,
        "max_audio_tokens": LIMITS.chat_audio_tokens,
        "speaker_id": SPEAKERS[speaker],
    }
    return dict(ref.run(inputs, walk="speak"))


def test_chat_with_audio_equals_the_reference(client: Any, ref: Any, eos: int) -> None:
    reply = client.chat.completions.create(
        model=OMNI,
        messages=[{"role": "user", "content": "Hi"}],
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "wav"},
        max_tokens=6,
    )
    message = reply.choices[0].message
    want = ref_chat_audio(ref, "Hi", "chelsie", 6)
    assert message.content is None and message.audio is not None
    assert message.audio.transcript == transcript(want, eos, 6)
    data = base64.b64decode(message.audio.data)
    assert data[:4] == b"RIFF"
    assert_pcm_close(data[44:], ref_pcm(want["waveform"]))
    assert reply.usage.prompt_tokens == chat_ids("Hi").shape[1]


def test_chat_with_audio_streams_transcript_and_pcm(client: Any, ref: Any, eos: int) -> None:
    stream = client.chat.completions.create(
        model=OMNI,
        messages=[{"role": "user", "content": "Sing"}],
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        max_tokens=12,
        stream=True,
    )
    said, data, kinds, finish = [], [], [], None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        piece = choice.delta.audio
        if piece is None:
            continue
        piece = piece if isinstance(piece, dict) else piece.model_dump()
        if piece.get("transcript"):
            said.append(piece["transcript"])
            kinds.append("t")
        if piece.get("data"):
            data.append(base64.b64decode(piece["data"]))
            kinds.append("a")
    want = ref_chat_audio(ref, "Sing", "ethan", 12)
    assert "".join(said) == transcript(want, eos, 12)
    assert_pcm_close(b"".join(data), ref_pcm(want["waveform"]))
    assert kinds.count("a") > 1 and finish == "stop"  # several audio chunks; the reply hit EOS


def test_text_only_chat_runs_the_chat_walk(client: Any, ref: Any, eos: int) -> None:
    messages = [{"role": "user", "content": "Words"}]
    want = ref.run({"input_ids": chat_ids("Words"), "max_new_tokens": 7}, walk="chat")
    reply = client.chat.completions.create(model=OMNI, messages=messages, max_tokens=7)
    assert reply.choices[0].message.content == transcript(want, eos, 7)
    stream = client.chat.completions.create(
        model=OMNI, messages=messages, max_tokens=7, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == transcript(want, eos, 7)


def test_chat_audio_rejects_what_it_cannot_do(client: Any) -> None:
    messages = [{"role": "user", "content": "x"}]
    audio = {"voice": "ethan", "format": "mp3"}
    with pytest.raises(openai.BadRequestError, match=r"'mp3' is not supported"):
        client.chat.completions.create(
            model=OMNI, messages=messages, modalities=["text", "audio"], audio=audio
        )
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'nova'"):
        client.chat.completions.create(
            model=OMNI,
            messages=messages,
            modalities=["text", "audio"],
            audio={"voice": "nova", "format": "wav"},
        )


# ---------------------------------------------------------------- speech formats, SSE


@pytest.fixture(scope="module")
def formats_ref(ref: Any) -> torch.Tensor:
    """The reference pcm16 samples of the speech request the format tests send."""
    return ref_pcm(ref_speech(ref, "Good day", "ethan", 40)["waveform"])


def speech_bytes(client: Any, fmt: str, **extra: Any) -> bytes:
    with client.audio.speech.with_streaming_response.create(
        model=OMNI,
        voice="ethan",
        input="Good day",
        response_format=fmt,
        extra_body={"max_tokens": 40, **extra},
    ) as response:
        sse = extra.get("stream_format") == "sse"
        kind = "text/event-stream" if sse else audiocodec.MEDIA_TYPES[fmt]
        assert response.headers["content-type"].startswith(kind)
        return b"".join(response.iter_bytes())


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])  # wav: the tests above
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_each_speech_format_decodes_to_the_served_samples(
    client: Any, formats_ref: torch.Tensor, streamed: bool, fmt: str
) -> None:
    """Decoded (PyAV) back, each format holds the reference's samples within one codec frame
    (a streamed mp3: two, LAME's flush), after the codec delay a format cannot signal (AAC's
    priming; a streamed mp3's LAME delay); FLAC holds the very samples."""
    n = formats_ref.shape[0]
    data = speech_bytes(client, fmt, **({"stream": True} if streamed else {}))
    back = audiocodec.decode(data, omni_http.SAMPLE_RATE, 60.0)
    lead = audiocodec.leading_samples(fmt, streamed)  # type: ignore[arg-type]
    frame = audiocodec.AudioEncoder(fmt, omni_http.SAMPLE_RATE).frame_size  # type: ignore[arg-type]
    slack = 2 * frame if fmt == "mp3" and streamed else frame  # LAME's flush, streamed
    assert 0 <= back.shape[0] - lead - n < slack, (fmt, back.shape[0], n)
    if fmt == "flac":
        assert_pcm_close(media.pcm16(back), formats_ref)


def test_speech_sse_events_as_openai_documents_them(client: Any, formats_ref: torch.Tensor) -> None:
    """``stream_format: "sse"``: ``speech.audio.delta`` events with base64 audio, then one
    ``speech.audio.done`` with usage; the deltas join into the reference's samples."""
    with client.audio.speech.with_streaming_response.create(
        model=OMNI,
        voice="ethan",
        input="Good day",
        response_format="pcm",
        stream_format="sse",
        extra_body={"max_tokens": 40},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :])
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    *deltas, done = events
    assert len(deltas) > 1 and all(set(e) == {"type", "audio"} for e in deltas)
    assert {e["type"] for e in deltas} == {"speech.audio.delta"}
    assert done["type"] == "speech.audio.done" and set(done) == {"type", "usage"}
    usage = done["usage"]
    assert set(usage) == {"input_tokens", "output_tokens", "total_tokens"}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    assert_pcm_close(b"".join(base64.b64decode(e["audio"]) for e in deltas), formats_ref)
    mp3 = speech_bytes(client, "mp3", stream_format="sse")  # SSE of a compressed format
    assert mp3.count(b"speech.audio.delta") >= 1 and b"speech.audio.done" in mp3


def test_speed_time_stretches_the_reference(client: Any, ref: Any) -> None:
    """``speed``: the reference waveform through the same atempo filter, whole or streamed
    (the filter's samples do not depend on the chunks)."""
    waveform = ref_speech(ref, "Good day", "ethan", 40)["waveform"]
    for speed, fmt, stream in ((2.0, "wav", False), (0.5, "pcm", True)):
        tempo = audiocodec.Tempo(speed, omni_http.SAMPLE_RATE)
        want = ref_pcm(torch.cat([tempo.feed(waveform), tempo.close()]))
        data = speech_bytes(client, fmt, speed=speed, **({"stream": True} if stream else {}))
        assert_pcm_close(data[44:] if fmt == "wav" else data, want)


def test_bad_speed_and_unknown_formats_are_400s_naming_the_field(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match=r"less than or equal to 4") as info:
        client.audio.speech.create(model=OMNI, voice="ethan", input="x", speed=5).read()
    assert info.value.body["param"] == "speed"
    with pytest.raises(openai.BadRequestError, match=r"'ogg' is not supported.*'mp3'") as info:
        client.audio.speech.create(
            model=OMNI, voice="ethan", input="x", response_format="ogg"
        ).read()
    assert info.value.body["param"] == "response_format"


# ---------------------------------------------------------------- /v1/audio/transcriptions

CLIP = torch.sin(torch.arange(32000) / 11.0) * 0.3  # 2 s at 16 kHz


def ref_transcription(
    ref: Any, eos: int, clip: bytes, language: str | None = None, context: str | None = None
) -> str:
    """The thinker's greedy reply through the reference walk, its inputs built here: the
    upload decoded (PyAV, to 16 kHz), upstream's WhisperFeatureExtractor called as upstream's
    processor calls it, the prompt by the adapter's own builder with the clip's placeholders."""
    features, placeholders = clip_features(clip)
    user = [10, *placeholders, *omni_transcribe.instruction(language, context).encode()]
    inputs = {
        "input_ids": qwen3_omni.chat_prompt(CONFIG, user, 10),
        **features,
        "max_new_tokens": LIMITS.max_text_tokens,
    }
    return transcript(dict(ref.run(inputs, walk="chat_audio")), eos, LIMITS.max_text_tokens)


def clip_features(clip: bytes) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The clip's walk inputs as upstream's processor makes them (the upload decoded by PyAV to
    16 kHz, WhisperFeatureExtractor called with the processor's arguments) and its
    placeholders ``<|audio_start|> <|audio_pad|> x N <|audio_end|>``."""
    from transformers import WhisperFeatureExtractor

    audio_config = CONFIG.thinker_config.audio_config
    wave = audiocodec.decode(clip, 16000, 60.0)
    extractor = WhisperFeatureExtractor(feature_size=audio_config.num_mel_bins)
    features = extractor(
        wave.numpy(),
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    frames = int(features["attention_mask"].sum())
    thinker = CONFIG.thinker_config
    count = int(qwen3_omni.audio_token_count(frames, audio_config.n_window))
    placeholders = [thinker.audio_start_token_id, *[thinker.audio_token_id] * count]
    inputs = {
        "input_features": features["input_features"],
        "feature_attention_mask": features["attention_mask"].to(torch.int64),
    }
    return inputs, [*placeholders, thinker.audio_end_token_id]


def test_transcription_equals_the_thinkers_greedy_reply(client: Any, ref: Any, eos: int) -> None:
    clip = audiocodec.encode(CLIP, "flac", 16000)
    want = ref_transcription(ref, eos, clip, context="hello")
    assert want  # the tiny thinker says something for this clip and prompt
    got = client.audio.transcriptions.create(
        model=OMNI, file=("clip.flac", clip, "audio/flac"), prompt="hello"
    )
    assert got.text == want
    text = client.audio.transcriptions.create(
        model=OMNI, file=("clip.flac", clip), prompt="hello", response_format="text"
    )
    assert text == want
    verbose = client.audio.transcriptions.create(
        model=OMNI, file=("clip.flac", clip), prompt="hello", response_format="verbose_json"
    )
    assert verbose.text == want and verbose.duration == pytest.approx(2.0)


def test_transcription_streams_and_takes_the_language(client: Any, ref: Any, eos: int) -> None:
    clip = audiocodec.encode(CLIP[:11200], "mp3", 16000)  # 0.7 s
    want = ref_transcription(ref, eos, clip, language="de", context="abc")
    assert want and want != ref_transcription(ref, eos, clip, context="abc")  # it is used
    stream = client.audio.transcriptions.create(
        model=OMNI, file=("clip.mp3", clip), language="de", prompt="abc", stream=True
    )
    events = list(stream)
    *deltas, done = events
    assert {e.type for e in deltas} == {"transcript.text.delta"} and len(deltas) > 1
    assert "".join(e.delta for e in deltas) == want
    assert done.type == "transcript.text.done" and done.text == want
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0


def test_transcription_rejects_what_it_cannot_read(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match=r"not audio that can be read") as info:
        client.audio.transcriptions.create(model=OMNI, file=("x.wav", b"not audio at all" * 9))
    assert info.value.body["param"] == "file"
    clip = audiocodec.encode(CLIP[:1600], "wav", 16000)
    with pytest.raises(openai.BadRequestError, match=r"'srt' is not supported"):
        client.audio.transcriptions.create(model=OMNI, file=("c.wav", clip), response_format="srt")
    with pytest.raises(openai.BadRequestError, match=r"timestamp_granularities"):
        client.audio.transcriptions.create(
            model=OMNI, file=("c.wav", clip), timestamp_granularities=["word"]
        )
    long = audiocodec.encode(torch.zeros(16000 * 31), "flac", 16000)
    with pytest.raises(openai.BadRequestError, match=r"longer than the limit of 30 s"):
        client.audio.transcriptions.create(model=OMNI, file=("long.flac", long))


def test_metrics_have_the_viability_gauge(omni: Any, client: Any) -> None:
    text = httpx.get(f"{omni.url}/metrics", timeout=30).text
    viability = read_metric(text, "walkserve:streaming_viability")
    assert viability is not None and 0.0 <= viability <= 1.0
    judged = read_metric(text, "walkserve:audio_chunks_judged_total")
    assert judged is not None and judged >= 2  # the streamed tests' chunks
    first = read_metric(text, "walkserve:time_to_first_audio_seconds_count")
    assert first is not None and first >= 3


# ---------------------------------------------------------------- media parts in chat


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
            r"takes no video",
            "messages[0].content[0]",
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


@pytest.fixture(scope="module")
def tiny_walks() -> Any:
    return qwen3_omni.tiny()[0]


def clips_features(clips: list[bytes]) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Several clips' walk inputs as upstream's processor makes them: WhisperFeatureExtractor
    called once on all of them (padded to the longest), and each clip's placeholders."""
    from transformers import WhisperFeatureExtractor

    audio_config = CONFIG.thinker_config.audio_config
    waves = [audiocodec.decode(clip, 16000, 60.0).numpy() for clip in clips]
    extractor = WhisperFeatureExtractor(feature_size=audio_config.num_mel_bins)
    out = extractor(
        waves,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = out["attention_mask"].to(torch.int64)
    thinker = CONFIG.thinker_config
    ids = []
    for frames in mask.sum(-1).tolist():
        count = int(qwen3_omni.audio_token_count(frames, audio_config.n_window))
        ids.append([thinker.audio_start_token_id, *[thinker.audio_token_id] * count])
        ids[-1].append(thinker.audio_end_token_id)
    return {"input_features": out["input_features"], "feature_attention_mask": mask}, ids


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
    want = tiny_walks.upstream.thinker.generate(
        ids,
        **audio,
        pixel_values=torch.cat([p[0]["pixel_values"] for p in pictures]),
        image_grid_thw=torch.cat([p[0]["image_grid_thw"] for p in pictures]),
        max_new_tokens=8,
        eos_token_id=eos,
        do_sample=False,
    )[0, ids.shape[1] :].tolist()
    want = want[: want.index(eos)] if eos in want else want
    text = bytes(t for t in want if t < 238).decode("utf-8", errors="replace")
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
