"""Uploaded videos for the HTTP API, through PyAV (FFmpeg's demuxers and decoders, as its wheels
bundle them): a file's first video stream -> the RGB frames a model reads.

Guarded before frames are decoded, as ``imagecodec`` guards images: the encoded bytes, the
frame size the stream declares, and then one pass over the packets (demuxed, not decoded)
counts the frames and measures the length against the limits (``profile.VideoLimits``). Only
then does the model's picker (``profile.FramePicker``: a frame count and rate -> indices)
choose frames, and a second pass decodes up to the last of them, converting only those to
RGB (``to_ndarray(format="rgb24")``, as transformers' PyAV reader converts them). A file
whose frames change size, or which holds fewer frames than its packets promised, is refused.

What crosses the boundary: bytes in, ``Video`` out. Bad input raises ``ValueError`` naming
the limit or the accepted containers.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from walkserve.api import audiocodec
from walkserve.api.profile import FramePicker, VideoLimits

# Demuxers accepted for uploads (FFmpeg names): common video files, not every format FFmpeg reads.
UPLOAD_CONTAINERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi"})
UPLOAD_ACCEPTED = "an mp4, mov, webm, mkv or avi video"


@dataclass(frozen=True)
class Video:
    frames: torch.Tensor  # [n, H, W, 3] uint8 RGB: the picked frames, in order
    fps: float  # the stream's average frame rate
    total_frames: int  # frames in the stream
    indices: tuple[int, ...]  # which frames of the stream ``frames`` are


def decode(data: bytes, limits: VideoLimits, pick: FramePicker) -> Video:
    """An uploaded video -> the frames ``pick`` chooses of its first video stream.
    ``ValueError`` for a file that is not a video of an accepted container, or passes one of
    ``limits``."""
    import av

    if not data:
        raise ValueError(f"the video file is empty; send {UPLOAD_ACCEPTED}")
    if len(data) > limits.max_bytes:
        raise ValueError(f"the video has {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    try:
        total, fps = _count(data, limits)
        indices = _picked(pick(total, fps), total)
        frames = _frames(data, indices, limits)
    except av.FFmpegError as e:
        raise ValueError(f"the video cannot be decoded ({e}); send {UPLOAD_ACCEPTED}") from None
    return Video(torch.from_numpy(np.stack(frames)), fps, total, tuple(indices))


def _open(data: bytes) -> tuple[Any, Any]:
    """(the container, its first video stream), checked."""
    container = audiocodec.open_upload(data, UPLOAD_CONTAINERS, "video", UPLOAD_ACCEPTED)
    if not container.streams.video:
        container.close()
        raise ValueError(f"the file has no video stream; send {UPLOAD_ACCEPTED}")
    return container, container.streams.video[0]


def _check_size(width: int, height: int, limits: VideoLimits) -> None:
    if width * height > limits.max_pixels:
        raise ValueError(
            f"the video's frames are {width}x{height} = {width * height} pixels; the limit is"
            f" {limits.max_pixels} pixels a frame"
        )


def _too_long(seconds: float, limits: VideoLimits) -> ValueError:
    return ValueError(f"the video is {seconds:.3g} s long; the limit is {limits.max_seconds:g} s")


def _count(data: bytes, limits: VideoLimits) -> tuple[int, float]:
    """(frames, frame rate) of the first video stream, from its packets (nothing decoded)."""
    container, stream = _open(data)
    try:
        ctx = stream.codec_context
        _check_size(int(ctx.width), int(ctx.height), limits)
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise ValueError("the video stream states no frame rate")
        fps = float(rate)
        if container.duration is not None and container.duration / 1e6 > limits.max_seconds:
            raise _too_long(container.duration / 1e6, limits)
        base: Fraction = stream.time_base or Fraction(0)
        total = 0
        for packet in container.demux(stream):
            if packet.size == 0:  # the demuxer's flush packet
                continue
            total += 1
            if total > limits.max_frames:
                raise ValueError(
                    f"the video has more than {limits.max_frames} frames; the limit is"
                    f" {limits.max_frames}"
                )
            at = float((packet.pts or 0) * base)  # seconds
            if at > limits.max_seconds:
                raise _too_long(at, limits)
    finally:
        container.close()
    if total == 0:
        raise ValueError("the video holds no frames")
    if total / fps > limits.max_seconds:
        raise _too_long(total / fps, limits)
    return total, fps


def _picked(indices: Sequence[int], total: int) -> list[int]:
    out = [int(i) for i in indices]
    if not out or any(b <= a for a, b in itertools.pairwise(out)) or out[0] < 0 or out[-1] >= total:
        raise ValueError(f"the model picks frames {out} of a video of {total} frames")
    return out


def _frames(data: bytes, indices: list[int], limits: VideoLimits) -> list[np.ndarray]:
    """The frames at ``indices`` (ascending) as [H, W, 3] uint8 RGB."""
    container, stream = _open(data)
    wanted, frames = set(indices), []
    size: tuple[int, int] | None = None
    try:
        for i, frame in enumerate(container.decode(stream)):
            if i > indices[-1]:
                break
            if (frame.width, frame.height) != (size or (frame.width, frame.height)):
                raise ValueError(f"the video's frames change size at frame {i}; send one size")
            size = (frame.width, frame.height)
            _check_size(frame.width, frame.height, limits)
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
    finally:
        container.close()
    if len(frames) < len(indices):
        raise ValueError(
            f"the video is truncated: its packets promised frame {indices[-1]}, it decodes to fewer"
        )
    return frames


def encode(frames: torch.Tensor, fps: int, fmt: str = "mp4", codec: str = "mpeg4") -> bytes:
    """frames [n, H, W, 3] uint8 RGB (H, W even) -> a video file of ``fmt`` (an FFmpeg muxer:
    mp4, webm, matroska, avi) at ``fps``, as a client would send one: the decoder's frames are
    this codec's reconstruction of them (lossy codecs), ``ffv1`` in matroska keeps them."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream: Any = container.add_stream(codec, rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        for pixels in frames.numpy():
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()
