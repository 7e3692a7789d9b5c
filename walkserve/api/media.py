"""Audio and image encodings for the HTTP API: 16-bit PCM, WAV (with a streaming header whose
sizes are left open), and PNG written and read with zlib and struct (no imaging library
needed). ``read_png`` accepts only what ``png`` writes (8-bit RGB, not interlaced, filter 0 on
every row) and raises ``ValueError`` naming that format for anything else."""

from __future__ import annotations

import struct
import zlib

import torch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_ACCEPTED = "8-bit RGB PNG, not interlaced, filter type 0 (unfiltered) on every row"

WAV_OPEN_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a stream whose length is not known yet


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
    rgb = image_to_uint8(image)  # [H, W, 3]
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


def read_png(data: bytes) -> torch.Tensor:
    """PNG bytes as ``png`` writes them -> image [3, H, W] float32 in [-1, 1].

    Layout read (every chunk: length, kind, payload, CRC; chunks other than IHDR, IDAT and
    IEND are skipped)::

        signature | IHDR width height 8 2 0 0 0 | IDAT ... | IEND
        inflated IDAT: per row, one filter byte (0) then width * 3 bytes R G B
    """

    def reject(why: str) -> ValueError:
        return ValueError(f"the image is not a supported PNG ({why}); accepted: {PNG_ACCEPTED}")

    if not data.startswith(PNG_SIGNATURE):
        raise reject("no PNG signature")
    pos, header, idat = len(PNG_SIGNATURE), None, bytearray()
    while True:
        if pos + 8 > len(data):
            raise reject("truncated before IEND")
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        payload = data[pos + 8 : pos + 8 + length]
        crc = data[pos + 8 + length : pos + 12 + length]
        if len(payload) != length or len(crc) != 4:
            raise reject(f"chunk {kind!r} is truncated")
        if struct.unpack(">I", crc)[0] != zlib.crc32(kind + payload) & 0xFFFFFFFF:
            raise reject(f"chunk {kind!r} has a wrong CRC")
        pos += 12 + length
        if kind == b"IHDR":
            if length != 13:
                raise reject("IHDR is not 13 bytes")
            header = struct.unpack(">IIBBBBB", payload)
        elif kind == b"IDAT":
            idat += payload
        elif kind == b"IEND":
            break
    if header is None:
        raise reject("no IHDR chunk")
    width, height, depth, color, compression, filtering, interlace = header
    if (depth, color, compression, filtering, interlace) != (8, 2, 0, 0, 0):
        raise reject(f"bit depth {depth}, colour type {color}, interlace {interlace}")
    if not 0 < width <= 4096 or not 0 < height <= 4096:
        raise reject(f"size {width}x{height}")
    stride = 1 + width * 3
    try:
        raw = zlib.decompressobj().decompress(bytes(idat), height * stride + 1)
    except zlib.error as e:
        raise reject(f"the image data does not inflate: {e}") from None
    if len(raw) != height * stride:
        raise reject(f"the image data is {len(raw)} bytes, expected {height * stride}")
    rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(height, stride)
    if bool((rows[:, 0] != 0).any()):
        raise reject("a row uses a filter other than 0")
    rgb = rows[:, 1:].reshape(height, width, 3)  # [H, W, 3] uint8
    return rgb.permute(2, 0, 1).float() / 127.5 - 1.0  # [3, H, W]
