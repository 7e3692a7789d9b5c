"""The uncompressed encodings of the HTTP API, written with the standard library: 16-bit PCM,
WAV (with a streaming header whose sizes are left open), and PNG (8-bit RGB, unfiltered rows,
zlib). Compressed audio is ``api.audiocodec``'s (PyAV); image input and JPEG / WebP output
``api.imagecodec``'s (Pillow)."""

from __future__ import annotations

import struct
import zlib
from typing import TypeVar

import torch

F = TypeVar("F", bound=str)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

WAV_OPEN_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a stream whose length is not known yet


def one_of(value: str, options: tuple[F, ...], field: str) -> F:
    """``value`` as one of a route's format names; ``ValueError`` naming ``field`` and them."""
    for option in options:
        if value == option:
            return option
    raise ValueError(f"{field} {value!r} is not supported: use one of {list(options)}")


def pcm16(waveform: torch.Tensor) -> bytes:
    """waveform [samples] or [1, samples], float in [-1, 1] -> little-endian int16 bytes."""
    samples = (waveform.detach().float().reshape(-1).clamp(-1.0, 1.0) * 32767.0).round()
    return samples.to(torch.int16).numpy().astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """The 44-byte header of mono 16-bit PCM; ``data_bytes=None`` for a stream."""
    data = WAV_OPEN_SIZE if data_bytes is None else data_bytes
    riff = WAV_OPEN_SIZE if data_bytes is None else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", data)
    )  # fmt: skip


def wav(waveform: torch.Tensor, sample_rate: int) -> bytes:
    data = pcm16(waveform)
    return wav_header(sample_rate, len(data)) + data


def image_to_uint8(image: torch.Tensor) -> torch.Tensor:
    """image [3, H, W] in [-1, 1] -> [H, W, 3] uint8."""
    pixels = ((image.detach().float().clamp(-1.0, 1.0) + 1.0) * 127.5).round()
    return pixels.to(torch.uint8).permute(1, 2, 0).contiguous()


def png(image: torch.Tensor) -> bytes:
    """image [3, H, W] in [-1, 1] -> PNG bytes (8-bit RGB, filter 0 on every row)."""
    return png_rgb(image_to_uint8(image))


def png_rgb(rgb: torch.Tensor) -> bytes:
    """rgb [H, W, 3] uint8 -> PNG bytes (8-bit RGB, filter 0 on every row)."""
    height, width, _ = rgb.shape
    rows = rgb.numpy().reshape(height, width * 3)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
