"""Speech over HTTP with the official ``openai`` client: ``walkserve serve`` of the tiny
Qwen3-Omni (the session's ``omni`` server, shared with ``test_chat_media_http``;
``tiny_audible``: its code2wav's output scaled so that the waveform survives pcm16); the tiny
Orpheus's voices are in ``test_speech_orpheus_http``. Every result is checked against the same
walk run by the reference interpreter with the same inputs, built with the adapters' own prompt
builders (``omni_reference``); audio is compared as 16-bit PCM (the relation: equal within one
LSB of rounding)."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import httpx
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
    chat_ids,
    clip_features,
    ref_pcm,
    transcript,
)

from walkserve.adapters import omni_http, omni_transcribe, qwen3_omni  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.api import audiocodec, media  # noqa: E402
from walkserve.api.metrics import read_metric  # noqa: E402


@pytest.fixture(scope="module")
def client(omni: Any) -> Any:
    return openai.OpenAI(base_url=f"{omni.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref() -> Any:
    return capture_model(OMNI)


@pytest.fixture(scope="module")
def eos() -> int:
    return qwen3_omni.tiny()[0].eos


def ref_speech(ref: Any, text: str, speaker: str, max_tokens: int) -> dict[str, Any]:
    inputs = {
        "input_ids": chat_ids(omni_http.READ_ALOUD.format(text=text)),
        "max_new_tokens": LIMITS.read_aloud_tokens,
        "max_audio_tokens": max_tokens,
        "speaker_id": SPEAKERS[speaker],
    }
    return dict(ref.run(inputs, walk="speak"))


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
