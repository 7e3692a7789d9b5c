"""Images for the HTTP API, through Pillow: an uploaded PNG (any bit depth, colour type, row
filter, interlace, palette or alpha), JPEG or WebP decoded to the RGB tensor a model takes,
and a generated image written as PNG, JPEG or WebP.

Decoding is guarded before any pixel is inflated: Pillow reads the header, the pixel count is
checked against the caller's limit (a decompression bomb is a small file that claims a huge
image), and only then is the image loaded. Alpha is composited onto white and palettes are
expanded, as transformers' ``convert_to_rgb`` does; 16-bit samples keep their high byte; EXIF
orientation is applied. PNG out is ``media.png`` (8-bit RGB, unfiltered rows), so its bytes do
not depend on the Pillow version.

What crosses the boundary: bytes in, image [3, H, W] float32 in [-1, 1] out (and back, or
8-bit RGB [H, W, 3] back for a model that makes its own 8-bit pixels). Bad
input raises ``ValueError`` naming the limit or the accepted formats.
"""

from __future__ import annotations

import io
from typing import Any, Literal

import numpy as np
import torch

from walkserve.api import media

ImageFormat = Literal["png", "jpeg", "webp"]
IMAGE_FORMATS: tuple[ImageFormat, ...] = ("png", "jpeg", "webp")
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow's names; no other decoder is tried
ACCEPTED = "a PNG, JPEG or WebP image"
DEFAULT_QUALITY = 90  # JPEG / WebP quality when output_compression is not given


def image_format(value: str) -> ImageFormat:
    return media.one_of(value, IMAGE_FORMATS, "output_format")


def decode(data: bytes, max_pixels: int) -> torch.Tensor:
    """An uploaded image -> [3, H, W] float32 in [-1, 1]. ``ValueError`` for anything that is
    not a whole PNG, JPEG or WebP, or holds more than ``max_pixels`` pixels."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        # formats= limits the decoders tried; the pixel guard below runs before load()
        with Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS) as im:
            width, height = im.size
            if width * height > max_pixels:
                raise ValueError(
                    f"the image is {width}x{height} = {width * height} pixels; the limit is"
                    f" {max_pixels} pixels"
                )
            im.load()
            rgb = _to_rgb(ImageOps.exif_transpose(im))
    except UnidentifiedImageError:
        raise ValueError(f"the file is not {ACCEPTED}") from None
    except Image.DecompressionBombError:  # Pillow's own guard, at open, past its far limit
        raise ValueError(
            f"the image holds too many pixels; the limit is {max_pixels} pixels"
        ) from None
    except (OSError, SyntaxError, EOFError) as e:  # truncated or corrupt data
        raise ValueError(f"the image is corrupt or truncated ({e}); send {ACCEPTED}") from None
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())  # [H, W, 3]
    return pixels.permute(2, 0, 1).float() / 127.5 - 1.0  # [3, H, W]


def _to_rgb(im: Any) -> Any:
    """Any Pillow mode -> 8-bit RGB (alpha over white, palettes expanded, 16 bits -> 8)."""
    from PIL import Image

    if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grey: Pillow's RGB would clip
        grey = (np.asarray(im, dtype=np.uint32) >> 8).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if (im.mode == "P" and "transparency" in im.info) or im.mode in ("LA", "PA", "La"):
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "RGBa"):
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im.convert("RGBA")).convert("RGB")
    return im.convert("RGB")


def encode(image: torch.Tensor, fmt: ImageFormat, quality: int | None = None) -> bytes:
    """image [3, H, W] in [-1, 1] -> ``fmt`` bytes; ``quality`` 0-100 for JPEG and WebP."""
    return encode_rgb(media.image_to_uint8(image), fmt, quality)


def encode_rgb(rgb: torch.Tensor, fmt: ImageFormat, quality: int | None = None) -> bytes:
    """rgb [H, W, 3] uint8 -> ``fmt`` bytes; ``quality`` 0-100 for JPEG and WebP."""
    if fmt == "png":
        return media.png_rgb(rgb)
    from PIL import Image

    pil = Image.fromarray(rgb.numpy(), "RGB")
    out = io.BytesIO()
    pil.save(out, format=fmt.upper(), quality=DEFAULT_QUALITY if quality is None else quality)
    return out.getvalue()
