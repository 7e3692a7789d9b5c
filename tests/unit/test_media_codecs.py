"""The media codecs of the HTTP API, no server: every speech format decodes back (PyAV) to the
encoded samples' length within one codec frame (plus the codec delay a format cannot signal,
named), streamed encoders write as they are fed; uploads decode and resample; images of every
PNG kind, JPEG and WebP decode to the pixels Pillow itself reads, and corrupt or oversized ones
are refused naming the limit before any pixel is inflated."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
PIL = pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from walkserve.api import audiocodec, imagecodec, media  # noqa: E402

RATE = 24000
WAVE = torch.sin(torch.arange(31_237) / 9.0) * 0.5  # 1.3 s, not a multiple of any frame size


def decoded_length(data: bytes, rate: int = RATE) -> int:
    return int(audiocodec.decode(data, rate, 60.0).shape[0])


def tail_slack(fmt: str, streamed: bool, frame: int) -> int:
    """The end's padding: to the frame; a streamed mp3's LAME flush, one frame more."""
    return 2 * frame if fmt == "mp3" and streamed else frame


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_speech_formats_decode_back_to_the_served_length(fmt: str, streamed: bool) -> None:
    enc = audiocodec.AudioEncoder(fmt, RATE, streamed=streamed)  # type: ignore[arg-type]
    parts = [enc.feed(c) for c in WAVE.split(3000)]
    data = b"".join(parts) + enc.close()
    n = WAVE.shape[0]
    extra = decoded_length(data) - audiocodec.leading_samples(fmt, streamed) - n  # type: ignore[arg-type]
    assert 0 <= extra < tail_slack(fmt, streamed, enc.frame_size), (fmt, extra, enc.frame_size)
    if streamed and fmt != "wav":
        assert sum(len(p) > 0 for p in parts) >= len(parts) // 2  # written as fed, not at close


@pytest.mark.parametrize("fmt", ["flac", "wav"])
def test_lossless_formats_hold_the_pcm16_samples(fmt: str) -> None:
    back = audiocodec.decode(audiocodec.encode(WAVE, fmt, RATE), RATE, 60.0)  # type: ignore[arg-type]
    want = torch.frombuffer(bytearray(media.pcm16(WAVE)), dtype=torch.int16).float() / 32768
    assert torch.equal(back, want)


def test_pcm_is_raw_samples_and_a_streamed_wav_leads_with_its_header() -> None:
    assert audiocodec.encode(WAVE, "pcm", RATE) == media.pcm16(WAVE)
    enc = audiocodec.AudioEncoder("wav", RATE, streamed=True)
    first = enc.feed(WAVE[:100])
    assert first[:4] == b"RIFF" and first[44:] == media.pcm16(WAVE[:100])
    assert enc.feed(WAVE[100:200]) == media.pcm16(WAVE[100:200]) and enc.close() == b""


def test_opus_at_an_unsupported_rate_is_resampled_by_the_encoder() -> None:
    data = audiocodec.encode(WAVE, "opus", 22050)  # libopus takes 8/12/16/24/48 kHz
    assert abs(decoded_length(data, 22050) - WAVE.shape[0]) < 960


def test_uploads_decode_to_mono_at_the_requested_rate() -> None:
    stereo = np.stack([WAVE.numpy(), -WAVE.numpy()]).astype(np.float32)  # [2, n]: mixes to 0
    out = io.BytesIO()
    with av.open(out, "w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=RATE, layout="stereo")
        frame = av.AudioFrame.from_ndarray(
            (stereo * 32767).astype("<i2").T.reshape(1, -1), format="s16", layout="stereo"
        )
        frame.sample_rate = RATE
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    back = audiocodec.decode(out.getvalue(), 16000, 60.0)
    assert abs(back.shape[0] - WAVE.shape[0] * 2 // 3) <= 2 and back.abs().max() < 1e-3
    mono = audiocodec.decode(audiocodec.encode(WAVE, "flac", RATE), 16000, 60.0)
    assert abs(mono.shape[0] - WAVE.shape[0] * 2 // 3) <= 2 and mono.abs().max() > 0.4


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"definitely not audio" * 20, "not audio that can be read"),
        (audiocodec.encode(WAVE, "wav", RATE), "longer than the limit of 1 s"),
        (media.png(torch.zeros(3, 4, 4)), "not accepted|not audio"),
    ],
    ids=["empty", "garbage", "too-long", "an-image"],
)
def test_bad_uploads_are_value_errors(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        audiocodec.decode(data, 16000, 1.0)


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 4.0])
def test_tempo_stretches_to_the_length_whatever_the_chunks(speed: float) -> None:
    whole = audiocodec.Tempo(speed, RATE)
    once = torch.cat([whole.feed(WAVE), whole.close()])
    chunked = audiocodec.Tempo(speed, RATE)
    parts = torch.cat([*[chunked.feed(c) for c in WAVE.split(1000)], chunked.close()])
    assert torch.equal(once, parts)
    filters = 2 if speed < 0.5 else 1
    window = audiocodec.Tempo.WINDOW_S * RATE * filters
    assert abs(once.shape[0] - WAVE.shape[0] / speed) < window


def test_unknown_speech_format_names_the_formats() -> None:
    with pytest.raises(ValueError, match=r"'ogg' is not supported.*'mp3', 'opus', 'aac'"):
        audiocodec.speech_format("ogg")


# ---------------------------------------------------------------- images

RGB = (np.arange(12 * 10 * 3) * 37 % 256).astype(np.uint8).reshape(12, 10, 3)


def saved(im: Image.Image, fmt: str, **kw: object) -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt, **kw)
    return out.getvalue()


def filtered_png(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG whose row r uses filter r % 5 (None, Sub, Up, Average, Paeth), as a
    libpng encoder may choose them (PNG spec, section 9)."""
    height, width, _ = rgb.shape
    rows, prev = [], np.zeros(width * 3, np.int32)
    for r in range(height):
        cur = rgb[r].reshape(-1).astype(np.int32)
        left = np.concatenate([np.zeros(3, np.int32), cur[:-3]])
        up_left = np.concatenate([np.zeros(3, np.int32), prev[:-3]])
        p = left + prev - up_left
        pa, pb, pc = np.abs(p - left), np.abs(p - prev), np.abs(p - up_left)
        paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, up_left))
        predictor = [0, left, prev, (left + prev) // 2, paeth][r % 5]
        rows.append(bytes([r % 5]) + ((cur - predictor) % 256).astype(np.uint8).tobytes())
        prev = cur
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        media.PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + _chunk(b"IEND", b"")
    )


def pixels(image: torch.Tensor) -> np.ndarray:
    return media.image_to_uint8(image).numpy()


def test_a_png_with_row_filters_decodes_to_its_pixels() -> None:
    data = filtered_png(RGB)
    assert np.array_equal(pixels(imagecodec.decode(data, 1000)), RGB)
    interlaced = saved(Image.fromarray(RGB), "PNG", interlace=1)
    assert np.array_equal(pixels(imagecodec.decode(interlaced, 1000)), RGB)


def test_png_kinds_become_rgb() -> None:
    palette = Image.fromarray(RGB).quantize(16)
    want = np.asarray(palette.convert("RGB"))
    assert np.array_equal(pixels(imagecodec.decode(saved(palette, "PNG"), 1000)), want)
    rgba = np.dstack([RGB, np.full((12, 10), 255, np.uint8)])
    rgba[0, 0, 3] = 0  # one transparent pixel: white
    got = pixels(imagecodec.decode(saved(Image.fromarray(rgba), "PNG"), 1000))
    assert np.array_equal(got[0, 0], [255, 255, 255]) and np.array_equal(got[1:], RGB[1:])
    grey16 = (np.arange(120, dtype=np.uint16).reshape(12, 10) * 500).astype(np.uint16)
    got = pixels(imagecodec.decode(saved(Image.fromarray(grey16), "PNG"), 1000))
    assert np.array_equal(got[..., 0], (grey16 >> 8).astype(np.uint8))  # not clipped at 255
    assert np.array_equal(got[..., 0], got[..., 2])


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_jpeg_and_webp_decode_as_pillow_reads_them(fmt: str) -> None:
    data = saved(Image.fromarray(RGB), fmt, quality=95)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(pixels(imagecodec.decode(data, 1000)), want)


def test_images_out_in_each_format() -> None:
    y, x = torch.meshgrid(torch.linspace(-1, 1, 24), torch.linspace(-1, 1, 20), indexing="ij")
    image = torch.stack([x, y, x * y]) * 0.9  # [3, 24, 20], smooth: JPEG keeps it
    rgb = media.image_to_uint8(image).numpy().astype(int)
    assert imagecodec.encode(image, "png") == media.png(image)
    for fmt, magic in (("jpeg", b"\xff\xd8"), ("webp", b"RIFF")):
        data = imagecodec.encode(image, fmt, 100)  # type: ignore[arg-type]
        assert data.startswith(magic)
        back = pixels(imagecodec.decode(data, 1000)).astype(int)
        assert back.shape == rgb.shape and np.abs(back - rgb).mean() < 3
    small = imagecodec.encode(image, "jpeg", 5)
    assert len(small) < len(imagecodec.encode(image, "jpeg", 100))


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def test_a_bomb_is_refused_before_decoding() -> None:
    # The header claims 100000 x 100000 pixels; no pixel data need follow.
    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    bomb = media.PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b""))
    with pytest.raises(ValueError, match=r"the limit is 4096 pixels"):
        imagecodec.decode(bomb + _chunk(b"IEND", b""), 4096)
    with pytest.raises(ValueError, match=r"120 pixels; the limit is 100 pixels"):
        imagecodec.decode(saved(Image.fromarray(RGB), "PNG"), 100)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (saved(Image.fromarray(RGB), "PNG")[:-30], "corrupt or truncated"),
        (saved(Image.fromarray(RGB), "JPEG")[:200], "corrupt or truncated"),
        (b"GIF89a" + b"\0" * 40, "not a PNG, JPEG or WebP"),
        (b"", "not a PNG, JPEG or WebP"),
    ],
    ids=["truncated-png", "truncated-jpeg", "gif", "empty"],
)
def test_corrupt_images_are_value_errors(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        imagecodec.decode(data, 1000)
