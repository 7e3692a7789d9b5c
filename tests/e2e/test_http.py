"""End to end over HTTP: ``walkserve serve`` as a subprocess on a free port, driven with the
official ``openai`` client (and httpx for what the client does not send). Every result is
checked against the same walk run through the reference interpreter with the same token ids
and inputs. The last test kills a worker, so it must stay last."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from walkserve.adapters import default  # noqa: E402
from walkserve.adapters.hf_causal_lm import sample_request  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.adapters.tokenizer import ByteTokenizer  # noqa: E402
from walkserve.api import imagecodec, media  # noqa: E402
from walkserve.api.metrics import read_metric  # noqa: E402
from walkserve.api.profile import plain_chat  # noqa: E402

KEY = "test-key"
MODEL = "walkserve-default"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = ByteTokenizer(default.TEXT_VOCAB)
SPEECH = ByteTokenizer(default.SPEECH_VOCAB)
IMAGE = ByteTokenizer(default.IMAGE_VOCAB)
PIXELS = 1 << 20  # the pixel limit of the test's own decodes


@pytest.fixture(scope="module")
def base_url(walkserve_serve: Any) -> Iterator[str]:
    with walkserve_serve("--api-key", KEY, "--max-queued", "4") as server:
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        pids = [r["pid"] for r in health["ranks"].values()]
        yield server.url
        out = server.stop()  # Ctrl-C: every worker shuts down
    assert "walkserve: stopped" in out, out
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):  # every worker is gone
        assert time.monotonic() < deadline, f"workers {pids} outlived walkserve serve"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref() -> Any:
    return capture_model(MODEL)


def ref_text(ref: Any, ids: list[int], max_tokens: int, **sampling: Any) -> list[int]:
    """The reference interpreter's tokens for a prompt, up to (without) EOS."""
    out = ref.run({**sample_request(ids, max_tokens), **sampling}, walk="prefill")
    tokens = [int(out["token"])] + (out["tokens"][0].tolist() if "tokens" in out else [])
    return tokens[: tokens.index(default.EOS_ID)] if default.EOS_ID in tokens else tokens


def ref_pcm(ref: Any, text: str, max_tokens: int = 32) -> torch.Tensor:
    inputs = {"prompt_ids": torch.tensor([SPEECH.encode(text)]), "max_new_tokens": max_tokens}
    return pcm_samples(media.pcm16(ref.run(inputs, walk="speak")["waveform"]))


def pcm_samples(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32)


def assert_pcm_close(got: bytes, want: torch.Tensor) -> None:
    samples = pcm_samples(got)
    assert samples.shape == want.shape and samples.numel() > 0
    assert (samples - want).abs().max().item() <= 1  # float rounding may flip one LSB


# ---------------------------------------------------------------- text


def test_models_lists_the_default_model(client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    extra = models[0].model_extra
    assert extra["image_sizes"] == ["16x16"] and extra["image_formats"] == ["png", "jpeg", "webp"]
    assert extra["speech_formats"] == ["mp3", "opus", "aac", "flac", "wav", "pcm"]


def test_completion_matches_the_reference(client: Any, ref: Any) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, extra_body={"return_token_ids": True}
    )
    want = ref_text(ref, TEXT.encode("Hello"), 12)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.text == TEXT.decode(want)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12
    ids = [5, 70, 200, 7]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    assert out.choices[0].model_extra["token_ids"] == ref_text(ref, ids, 5)


def test_completion_stream_matches_the_reference(client: Any, ref: Any) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stream me",
            max_tokens=10,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    want = ref_text(ref, TEXT.encode("Stream me"), 10)
    tokens = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert tokens == want
    assert "".join(c.choices[0].text for c in chunks) == TEXT.decode(want)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_matches_the_reference(client: Any, ref: Any) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    want = ref_text(ref, TEXT.encode(plain_chat([("user", "Hi there")])), 8)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert out.choices[0].message.content == TEXT.decode(want)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT.decode(want)
    assert chunks[-1].usage.completion_tokens == 8


def test_sampled_choices_match_the_reference(client: Any, ref: Any) -> None:
    """n choices, choice i drawn with seed + i, each equal to the reference interpreter's walk
    with the same sampling inputs; streamed choices interleave but each keeps its order."""
    ids = TEXT.encode("Sample")
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}
    want = [ref_text(ref, ids, 10, **sampling, seed=7 + i) for i in range(3)]
    assert len({tuple(w) for w in want}) > 1  # the seeds matter
    out = client.completions.create(
        model=MODEL,
        prompt="Sample",
        max_tokens=10,
        n=3,
        seed=7,
        temperature=0.9,
        top_p=0.95,
        extra_body={"top_k": 40, "return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in out.choices] == want
    assert out.usage.completion_tokens == sum(
        min(10, len(w) + (len(w) < 10)) for w in want
    )  # EOS counts as generated
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Sample"}],
            max_tokens=6,
            n=2,
            seed=3,
            temperature=0.9,
            stream=True,
        )
    )
    prompt = TEXT.encode(plain_chat([("user", "Sample")]))
    for i in range(2):
        text = "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        assert text == TEXT.decode(ref_text(ref, prompt, 6, temperature=0.9, seed=3 + i))


def test_stop_string_ends_the_completion(client: Any, ref: Any) -> None:
    full = TEXT.decode(ref_text(ref, TEXT.encode("Hello"), 12))
    stop = full[3:5]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- speech and image


def test_speech_wav_matches_the_reference(client: Any, ref: Any) -> None:
    data = client.audio.speech.create(model=MODEL, voice="alloy", input="Say this").read()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert struct.unpack("<I", data[24:28])[0] == default.SAMPLE_RATE
    assert_pcm_close(data[44:], ref_pcm(ref, "Say this"))


def test_speech_stream_sends_chunks_as_produced(client: Any, ref: Any) -> None:
    with client.audio.speech.with_streaming_response.create(
        model=MODEL,
        voice="alloy",
        input="Say this",
        response_format="pcm",
        extra_body={"stream": True},
    ) as response:
        chunks = [c for c in response.iter_bytes() if c]
    assert_pcm_close(b"".join(chunks), ref_pcm(ref, "Say this"))


def png_pixels(data: bytes) -> torch.Tensor:
    """RGB pixels of a PNG written with filter 0 on every row -> [H, W, 3] uint8."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    rows = [raw[r * (1 + 3 * width) + 1 : (r + 1) * (1 + 3 * width)] for r in range(height)]
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(height, width, 3)


def test_image_matches_the_reference(client: Any, ref: Any) -> None:
    out = client.images.generate(
        model=MODEL, prompt="a red square", size="16x16", extra_body={"seed": 3}
    )
    pixels = png_pixels(base64.b64decode(out.data[0].b64_json)).to(torch.int32)
    noise = torch.randn((1, *default.NOISE_SHAPE), generator=torch.Generator().manual_seed(3))
    inputs = {"prompt_ids": torch.tensor([IMAGE.encode("a red square")]), "noise": noise}
    want = media.image_to_uint8(ref.run(inputs, walk="generate")["image"][0]).to(torch.int32)
    assert pixels.shape == (16, 16, 3)
    assert (pixels - want).abs().max().item() <= 1


def test_image_edit_matches_the_reference(client: Any, ref: Any) -> None:
    source = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(7)) * 2 - 1
    upload = media.png(source)
    out = client.images.edit(
        model=MODEL,
        image=("in.png", upload, "image/png"),
        prompt="make it blue",
        size="16x16",
        n=1,
        response_format="b64_json",
        extra_body={"seed": 0},
    )
    pixels = png_pixels(base64.b64decode(out.data[0].b64_json)).to(torch.int32)
    noise = torch.randn((1, *default.NOISE_SHAPE), generator=torch.Generator().manual_seed(0))
    inputs = {
        "prompt_ids": torch.tensor([IMAGE.encode("make it blue")]),
        "image": imagecodec.decode(upload, PIXELS)[None],  # the pixels the server saw
        "noise": noise,
    }
    want = media.image_to_uint8(ref.run(inputs, walk="edit")["image"][0]).to(torch.int32)
    assert pixels.shape == (16, 16, 3)
    assert (pixels - want).abs().max().item() <= 1


def test_images_without_a_seed_differ_and_come_in_each_format(client: Any) -> None:
    def pixels(**kw: Any) -> torch.Tensor:
        out = client.images.generate(model=MODEL, prompt="a red square", size="16x16", **kw)
        return imagecodec.decode(base64.b64decode(out.data[0].b64_json), PIXELS)

    assert not torch.equal(pixels(), pixels())  # a random seed each time
    drawn = client.images.generate(model=MODEL, prompt="a red square").data[0]
    again = pixels(extra_body={"seed": drawn.model_extra["seed"]})  # the answer says its seed
    assert torch.equal(again, imagecodec.decode(base64.b64decode(drawn.b64_json), PIXELS))
    seeded = pixels(extra_body={"seed": 3})
    for fmt in ("jpeg", "webp"):
        out = client.images.generate(
            model=MODEL, prompt="a red square", output_format=fmt, extra_body={"seed": 3}
        )
        assert out.output_format == fmt
        # the seeded image's pixels, written by the same Pillow as the server's
        assert base64.b64decode(out.data[0].b64_json) == imagecodec.encode(seeded, fmt)


def _pillow(fmt: str, image: torch.Tensor, **kw: Any) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(media.image_to_uint8(image).numpy()).save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_image_edit_takes_png_jpeg_and_webp(client: Any, ref: Any, fmt: str) -> None:
    """Pillow's files (its PNG with per-row filters chosen by zlib's strategy and optimize, a
    JPEG, a lossy WebP): the edit equals the reference run on the pixels Pillow decodes."""
    source = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(8)) * 2 - 1
    upload = _pillow(fmt, source, **({"optimize": True} if fmt == "PNG" else {"quality": 80}))
    out = client.images.edit(
        model=MODEL,
        image=(f"in.{fmt.lower()}", upload, f"image/{fmt.lower()}"),
        prompt="make it blue",
        extra_body={"seed": 5},
    )
    pixels = png_pixels(base64.b64decode(out.data[0].b64_json)).to(torch.int32)
    noise = torch.randn((1, *default.NOISE_SHAPE), generator=torch.Generator().manual_seed(5))
    inputs = {
        "prompt_ids": torch.tensor([IMAGE.encode("make it blue")]),
        "image": imagecodec.decode(upload, PIXELS)[None],
        "noise": noise,
    }
    want = media.image_to_uint8(ref.run(inputs, walk="edit")["image"][0]).to(torch.int32)
    assert (pixels - want).abs().max().item() <= 1


def _bomb() -> bytes:
    """A PNG whose header claims 50000 x 50000 pixels (over the default limit of 4096^2)."""
    ihdr = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
    parts = [(b"IHDR", ihdr), (b"IDAT", zlib.compress(b"")), (b"IEND", b"")]
    return media.PNG_SIGNATURE + b"".join(
        struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d)) for k, d in parts
    )


@pytest.mark.parametrize(
    ("image", "size", "message"),
    [
        (b"GIF89a not a png", "16x16", "not a PNG, JPEG or WebP"),
        (media.png(torch.zeros(3, 16, 16))[:-30], "16x16", "corrupt or truncated"),
        (_bomb(), "16x16", "the limit is 16777216 pixels"),
        (media.png(torch.zeros(3, 8, 8)), "16x16", "is 8x8 pixels"),
        (media.png(torch.zeros(3, 16, 16)), "32x32", "16x16 images only"),
    ],
    ids=["malformed", "truncated", "oversized", "wrong-image-size", "wrong-size-field"],
)
def test_image_edit_rejects_bad_images(
    base_url: str, image: bytes, size: str, message: str
) -> None:
    r = httpx.post(
        f"{base_url}/v1/images/edits",
        files={"image": ("in.png", image, "image/png")},
        data={"model": MODEL, "prompt": "a", "size": size},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text


def test_image_edit_needs_multipart_with_an_image(base_url: str) -> None:
    r = httpx.post(
        f"{base_url}/v1/images/edits", json={"model": MODEL, "prompt": "a"}, headers=AUTH
    )
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    r = httpx.post(
        f"{base_url}/v1/images/edits",
        data={"model": MODEL, "prompt": "a"},
        headers=AUTH,
        files={"other": ("x.txt", b"x", "text/plain")},
    )
    assert r.status_code == 400 and "'image'" in r.json()["error"]["message"], r.text
    png = media.png(torch.zeros(3, 16, 16))
    r = httpx.post(
        f"{base_url}/v1/images/edits",
        data={"model": MODEL, "prompt": "a"},
        headers=AUTH,
        files={"image": ("in.png", png, "image/png"), "mask": ("m.png", png, "image/png")},
    )
    assert r.status_code == 400 and "mask is not supported" in r.json()["error"]["message"]


# ---------------------------------------------------------------- any walk


def test_walk_route_json_b64_and_sse(base_url: str, ref: Any) -> None:
    ids = [[5, 9, 12]]
    want = ref.run({"prompt_ids": torch.tensor(ids), "max_new_tokens": 4}, walk="speak")
    body: dict[str, Any] = {"inputs": {"prompt_ids": ids, "max_new_tokens": 4}, "encoding": "b64"}
    r = httpx.post(f"{base_url}/v1/walks/speak", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    codes = r.json()["outputs"]["codes"]
    got = torch.frombuffer(bytearray(base64.b64decode(codes["b64"])), dtype=torch.int64)
    assert got.view(codes["shape"]).tolist() == want["codes"].tolist()

    prompt = torch.tensor([[9, 40, 77]])  # int64 prompt ids sent as raw bytes
    b64 = {"b64": base64.b64encode(prompt.numpy().tobytes()).decode(), "dtype": "int64"}
    sampling = {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 4}
    inputs = {"input_ids": {**b64, "shape": [1, 3]}, "max_new_tokens": 5, **sampling}
    r = httpx.post(f"{base_url}/v1/walks/prefill", json={"inputs": inputs}, headers=AUTH)
    assert r.status_code == 200, r.text
    want_text = ref.run({"input_ids": prompt, "max_new_tokens": 5, **sampling}, walk="prefill")
    assert r.json()["outputs"]["tokens"] == want_text["tokens"].tolist()

    plain = {k: v for k, v in sample_request([5, 6, 7], 3).items() if k != "constraints"}
    inputs = {**plain, "input_ids": [[5, 6, 7]]}  # the prefill walk takes no constraints
    body = {"inputs": inputs, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/walks/prefill", json=body, headers=AUTH) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    want_tokens = ref.run(sample_request([5, 6, 7], 3))
    assert [e["value"][0][0] for e in events[:-1]] == want_tokens["tokens"][0].tolist()
    assert events[-1]["outputs"]["tokens"] == want_tokens["tokens"].tolist()


def test_walk_route_bounds_work_per_request(base_url: str, ref: Any) -> None:
    """Bounded work on ``/v1/walks/*`` (walkserve serve's defaults: inputs 32768 long, loops
    of 65536, 32 rows; each row counts against --max-queued 4): 400s naming the input and
    the limit, and the server serves the next walk as the reference does."""

    def walk(inputs: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{base_url}/v1/walks/speak", json={"inputs": inputs}, headers=AUTH, timeout=60
        )

    cases = [  # (inputs, param, words)
        ({"prompt_ids": [[5] * 100_000], "max_new_tokens": 4}, "prompt_ids", "at most 32768"),
        ({"prompt_ids": [[5, 9]], "max_new_tokens": 100_000}, "max_new_tokens", "at most 65536"),
        ({"prompt_ids": [[5, 9]] * 5, "max_new_tokens": 2}, "prompt_ids", "--max-queued 4"),
    ]
    for inputs, param, words in cases:
        r = walk(inputs)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == f"inputs.{param}" and words in error["message"], error
    r = walk({"prompt_ids": [[5, 9, 12]], "max_new_tokens": 3})
    assert r.status_code == 200, r.text
    want = ref.run({"prompt_ids": torch.tensor([[5, 9, 12]]), "max_new_tokens": 3}, walk="speak")
    assert r.json()["outputs"]["codes"] == want["codes"].tolist()


# ---------------------------------------------------------------- validation


BIG = "x" * (9 << 20)
ERRORS = [
    ("/v1/completions", "{bad json", "not valid JSON"),
    ("/v1/completions", "[1, 2]", "must be a JSON object"),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "{BIG}"}}', "limit is"),
    ("/v1/completions", {"prompt": "a"}, "model: Field required"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, "model 'gpt-4' is not served"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, "greater than"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 9999}, "too large"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 600}, "the limit is 512"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, "outside [0, 259)"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": 5}, "less than"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, "greater than"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_k": -2}, "greater than or equal"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": 2**63}, "less than"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 17}, "n=17 is too large"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, "non-empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x"}]}, "role"),
    (
        "/v1/audio/speech",
        {"model": MODEL, "input": "hi", "response_format": "ogg"},
        "'mp3', 'opus'",
    ),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "speed": 5}, "speed: Input should be"),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "max_tokens": 999}, "too large"),
    ("/v1/images/generations", {"model": MODEL, "prompt": "a", "size": "512x512"}, "16x16"),
    ("/v1/images/generations", {"model": MODEL, "prompt": "a", "n": 2}, "n=2"),
    ("/v1/images/generations", {"model": MODEL, "prompt": "a", "response_format": "url"}, "url"),
    ("/v1/walks/nope", {"inputs": {}}, "unknown walk 'nope'"),
    ("/v1/walks/speak", {"inputs": {"prompt_ids": [[1]]}}, "needs inputs ['max_new_tokens']"),
    ("/v1/walks/speak", {"inputs": {"prompt_ids": [[1]], "max_new_tokens": "8"}}, "JSON int"),
    ("/v1/walks/speak", {"inputs": {"prompt_ids": [1], "max_new_tokens": 8}}, "2 dimensions"),
    (
        "/v1/walks/generate",
        {"inputs": {"prompt_ids": [[1]], "noise": {"b64": "!!", "dtype": "float32", "shape": [1]}}},
        "not valid base64",
    ),
    (
        "/v1/walks/generate",
        {
            "inputs": {
                "prompt_ids": [[1]],
                "noise": {"b64": "AAAA", "dtype": "float32", "shape": [2]},
            }
        },
        "needs 8",
    ),
]


@pytest.mark.parametrize(("path", "body", "message"), ERRORS, ids=[e[2][:24] for e in ERRORS])
def test_bad_requests_get_400_saying_what_to_fix(
    base_url: str, path: str, body: Any, message: str
) -> None:
    if isinstance(body, str):
        r = httpx.post(f"{base_url}{path}", content=body, headers=AUTH, timeout=60)
    else:
        r = httpx.post(f"{base_url}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error


def test_transcriptions_are_404_for_a_model_without_audio_input(client: Any) -> None:
    with pytest.raises(openai.NotFoundError, match="takes no audio input"):
        clip = media.wav(torch.zeros(1600), 16000)
        client.audio.transcriptions.create(model=MODEL, file=("a.wav", clip, "audio/wav"))


def test_openai_client_sees_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="too large"):
        client.completions.create(model=MODEL, prompt="a", n=99)


ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/audio/speech"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/walks/speak"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_but_health_needs_the_key(base_url: str, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{base_url}{path}", headers=headers, json={}, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=30).text
    value = read_metric(text, name, **labels)
    assert value is not None, f"no metric {name} {labels}"
    return value


def test_metrics_cover_tokens_audio_and_the_kv_pool(base_url: str, client: Any) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=6)
    client.audio.speech.create(model=MODEL, voice="alloy", input="metrics").read()
    assert metric(base_url, "walkserve:inter_token_latency_seconds_count") >= 5
    assert metric(base_url, "walkserve:time_to_first_token_seconds_count") >= 1
    assert metric(base_url, "walkserve:time_to_first_audio_seconds_count") >= 1
    assert metric(base_url, "walkserve:real_time_factor_count") >= 1
    assert metric(base_url, "walkserve:kv_pages", rank="0", component="lm") > 0


def test_over_max_queued_gets_503_with_retry_after(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 64}
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        r = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=120)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 503 in codes, codes
    busy = next(r for r in results if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "retry later" in busy.json()["error"]["message"]
    assert metric(base_url, "walkserve:num_requests_waiting") == 0


def test_client_disconnect_cancels_the_request(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "long", "max_tokens": 256, "stream": True}
    cancelled = metric(base_url, "walkserve:cancelled_requests_total")
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=60
    ) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")  # mid-stream: close the connection now
    deadline = time.monotonic() + 20
    while (
        metric(base_url, "walkserve:num_requests_running") != 0
        or metric(base_url, "walkserve:num_requests_waiting") != 0
    ):
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.1)
    assert metric(base_url, "walkserve:cancelled_requests_total") == cancelled + 1


def test_a_client_leaving_a_non_streamed_request_cancels_it(base_url: str, ref: Any) -> None:
    """The request must still be running when the client leaves: a prompt whose greedy
    decode makes no EOS in the first 512 tokens (checked on the reference)."""
    prompt = next(
        p
        for p in ("long", "longer", "longest", "lengthy")
        if len(ref_text(ref, TEXT.encode(p), 512)) == 512
    )
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 512}).encode()
    cancelled = metric(base_url, "walkserve:cancelled_requests_total")
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.5)  # the request is running; leave without reading the answer
    deadline = time.monotonic() + 20
    while (
        metric(base_url, "walkserve:num_requests_running") != 0
        or metric(base_url, "walkserve:num_requests_waiting") != 0
        or metric(base_url, "walkserve:kv_pages_in_use", rank="0", component="lm") != 0
    ):
        assert time.monotonic() < deadline, "the abandoned request still holds its state"
        time.sleep(0.1)
    assert metric(base_url, "walkserve:cancelled_requests_total") == cancelled + 1


def test_health_is_503_when_a_worker_dies(base_url: str) -> None:
    """Must stay last: it kills the only worker (which is then started again)."""
    ranks = httpx.get(f"{base_url}/health", timeout=30).json()["ranks"]
    os.kill(ranks["0"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while (r := httpx.get(f"{base_url}/health", timeout=30)).status_code != 503:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["ranks"]["0"]["status"] in ("dead", "restarting", "starting")
    assert r.headers["retry-after"]
    body = {"model": MODEL, "prompt": "again", "max_tokens": 4}
    meanwhile = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=120)
    if meanwhile.status_code != 200:  # not back yet (it usually is not: a start takes seconds)
        assert meanwhile.status_code == 503 and meanwhile.headers["retry-after"], meanwhile.text
        assert "restarting" in meanwhile.json()["error"]["message"]
    # The rank comes back (restarted with its weights and plan) and serves again.
    deadline = time.monotonic() + 120
    while (r := httpx.get(f"{base_url}/health", timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["ranks"]["0"]["restarts"] == 1
    again = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert again.status_code == 200, again.text
