"""Video parts of a chat for an Omni thinker's vision tower, made as upstream's
``Qwen2VLVideoProcessor`` (the video processor of Qwen2.5-Omni and Qwen3-Omni) makes them, in
torch alone: that class needs torchvision, which cannot be installed beside every torch build;
where it imports, ``video_inputs`` calls it instead (``upstream_video_processor``).

    frames      the decoded video's frames at ``fps`` (upstream ``sample_frames`` with fps:
                total / video_fps * fps, clamped to [min_frames, max_frames, total], floored
                to a multiple of temporal_patch_size; indices arange(0, total, total / n))
    resize      each frame to ``smart_resize`` (h, w multiples of patch * merge, pixels in
                [min_pixels, max_pixels]): bicubic with antialiasing on the uint8 frames, as
                torchvision's ``resize`` does it on the CPU (``interpolate`` on uint8; on a
                GPU torchvision casts to float, clamps and rounds: frames here are PyAV's,
                on the CPU)
    normalize   (x - 255 * mean) / (255 * std) in float32 (the fused rescale and normalize)
    patchify    frames padded to a multiple of temporal_patch_size with copies of the last;
                [T, C, H, W] -> [t * h * w, C * tp * p * p], patches in merge-window order:

                    t, (h / m, w / m), (m, m) | C, tp, p, p
                    ^ rows                      ^ one patch's values

    out         pixel_values_videos [patches, C * tp * p * p], video_grid_thw [1, 3] (t, h, w
                in patches), video_second_per_grid [1] = temporal_patch_size / fps (as
                upstream's Qwen2.5-Omni processor sets it); placeholders
                <|vision_bos|> <|VIDEO|> x t*h*w/merge^2 <|vision_eos|>

What crosses the boundary: the vision config's sizes and the processor's (``VideoSettings``);
decoded videos (``api.videocodec.Video``) in, ``api.profile`` media inputs out.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from walkserve.api.chatmedia import per_part
from walkserve.api.profile import FramePicker, MediaInputs, VideoLimits

# Upstream ``Qwen2VLVideoProcessor``'s class defaults (its module imports torchvision, so
# they are read from it only where it imports: ``upstream_defaults``).
FPS = 2.0  # Qwen2.5-Omni's processor: "default fps not saved in official ckpt"
MIN_FRAMES, MAX_FRAMES = 4, 768
TINY_VIDEO_PIXELS = 32 * 32  # the tiny vision towers' video frames at most (resized)
# what the tiny profiles take of one upload (small, so tests can pass each limit cheaply)
TINY_VIDEO_LIMITS = VideoLimits(
    max_bytes=1 << 20, max_seconds=10.0, max_frames=64, max_pixels=320 * 240
)


@dataclass(frozen=True)
class VideoSettings:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # a resized frame's pixels at least (size["shortest_edge"])
    max_pixels: int  # and at most (size["longest_edge"])
    fps: float = FPS  # frames read a second
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
    std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
    rescale: float = 1 / 255

    def __post_init__(self) -> None:
        if min(self.patch_size, self.merge_size, self.temporal_patch_size) < 1:
            raise ValueError(f"patch, merge and temporal sizes must be >= 1: {self}")
        if not 0 < self.min_pixels <= self.max_pixels or not self.fps > 0:
            raise ValueError(f"video settings need 0 < min_pixels <= max_pixels, fps > 0: {self}")


def pick_frames(settings: VideoSettings) -> FramePicker:
    """The frames upstream ``sample_frames`` reads at ``settings.fps`` of a video of ``total``
    frames at ``video_fps``."""
    tp = settings.temporal_patch_size

    def pick(total: int, video_fps: float) -> list[int]:
        most = math.floor(min(settings.max_frames, total) / tp) * tp
        n = min(max(total / video_fps * settings.fps, settings.min_frames), most, total)
        n = math.floor(n / tp) * tp
        if n < 1:
            raise ValueError(
                f"the video has {total} frames; the model reads at least {tp} at"
                f" {settings.fps:g} frames a second"
            )
        indices: list[int] = torch.arange(0, total, total / n).int().tolist()
        return indices

    return pick


def resized(frames: Tensor, height: int, width: int) -> Tensor:
    """frames [T, C, H, W] uint8 (PyAV's, on the CPU) -> [T, C, height, width] uint8: bicubic,
    antialiased, as torchvision's ``resize`` computes it on the CPU (torch's native uint8
    kernel; unchanged when the size is already right)."""
    if frames.shape[-2:] == (height, width):
        return frames
    return torch.nn.functional.interpolate(
        frames.cpu(), size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )


def patchify(video: Tensor, settings: VideoSettings) -> tuple[Tensor, list[int]]:
    """video [T, C, H, W] float (H, W multiples of patch * merge) -> (patches
    [t * h * w, C * tp * p * p], [t, h, w]); see the module docstring for the order."""
    p, m, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    short = -video.shape[0] % tp
    if short:  # pad with copies of the last frame
        video = torch.cat([video, video[-1:].expand(short, -1, -1, -1)])
    frames, channels, height, width = video.shape
    t, h, w = frames // tp, height // p, width // p
    grid = video.reshape(t, tp, channels, h // m, m, p, w // m, m, p)
    #        dims:       0  1   2         3       4  5  6       7  8
    grid = grid.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/m, w/m, m, m | C, tp, p, p
    return grid.reshape(t * h * w, channels * tp * p * p), [t, h, w]


def preprocess(frames: Tensor, settings: VideoSettings) -> tuple[Tensor, Tensor]:
    """frames [T, H, W, 3] uint8 RGB (already picked) -> pixel_values_videos
    [patches, 3 * tp * p * p] float32, video_grid_thw [1, 3] int64."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    video = frames.permute(0, 3, 1, 2).contiguous()  # [T, C, H, W]
    height, width = smart_resize(
        video.shape[-2],
        video.shape[-1],
        factor=settings.patch_size * settings.merge_size,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )
    video = resized(video, height, width)
    mean = torch.tensor(settings.mean) * (1.0 / settings.rescale)
    std = torch.tensor(settings.std) * (1.0 / settings.rescale)
    normal = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    patches, grid = patchify(normal, settings)
    return patches, torch.tensor([grid], dtype=torch.int64)


def upstream_video_processor(settings: VideoSettings) -> Any | None:
    """Upstream's ``Qwen2VLVideoProcessor`` with ``settings`` where torchvision imports; None
    elsewhere."""
    from transformers.utils import is_torchvision_v2_available

    if not is_torchvision_v2_available():
        return None
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(
        patch_size=settings.patch_size,
        merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size,
        size={"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
        image_mean=list(settings.mean),
        image_std=list(settings.std),
        do_sample_frames=False,
        cap_pixels_per_frame=False,
    )


def video_inputs(settings: VideoSettings, start: int, pad: int, end: int) -> MediaInputs:
    """Videos (``api.videocodec.Video``: the frames ``pick_frames`` chose) ->
    ``pixel_values_videos``, ``video_grid_thw``, ``video_second_per_grid`` of each alone
    (upstream's processor resizes each video by its own size) and each one's placeholders;
    through upstream's video processor where torchvision imports."""
    upstream = upstream_video_processor(settings)
    merge = settings.merge_size

    def inputs(video: Any) -> tuple[dict[str, Any], list[int]]:
        if upstream is not None:
            out = upstream(videos=[video.frames.numpy()], return_tensors="pt")
            patches, grid = out["pixel_values_videos"], out["video_grid_thw"].to(torch.int64)
        else:
            patches, grid = preprocess(video.frames, settings)
        seconds = torch.tensor([settings.temporal_patch_size / settings.fps])  # float32
        media = {
            "pixel_values_videos": patches,
            "video_grid_thw": grid,
            "video_second_per_grid": seconds,
        }
        return media, [start, *[pad] * (int(grid.prod()) // merge**2), end]

    return per_part(inputs)


def tiny_video_settings(vision_config: Any, max_pixels: int) -> VideoSettings:
    """A tiny config's vision tower's sizes; frames resized to at most ``max_pixels``."""
    factor = int(vision_config.patch_size * vision_config.spatial_merge_size)
    return VideoSettings(
        patch_size=int(vision_config.patch_size),
        merge_size=int(vision_config.spatial_merge_size),
        temporal_patch_size=int(vision_config.temporal_patch_size),
        min_pixels=factor * factor,
        max_pixels=max_pixels,
    )


def checkpoint_video_settings(path: str, vision_config: Any, size: dict[str, int]) -> VideoSettings:
    """A checkpoint's video settings: the vision tower's sizes, ``size`` (the processor's
    ``videos_kwargs`` size, which its calls pass), and the frame counts, mean and std of its
    ``video_preprocessor_config.json`` where it has one (the fps is the processor's own:
    ``FPS``)."""
    found: dict[str, Any] = {}
    file = os.path.join(path, "video_preprocessor_config.json")
    if os.path.isfile(file):
        with open(file) as f:
            found = json.load(f)
    return VideoSettings(
        patch_size=int(vision_config.patch_size),
        merge_size=int(vision_config.spatial_merge_size),
        temporal_patch_size=int(vision_config.temporal_patch_size),
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
        min_frames=int(found.get("min_frames", MIN_FRAMES)),
        max_frames=int(found.get("max_frames", MAX_FRAMES)),
        mean=tuple(found.get("image_mean", VideoSettings.mean)),
        std=tuple(found.get("image_std", VideoSettings.std)),
    )


class TorchVideoProcessor:
    """``preprocess`` called as upstream's processors call their video processor (videos
    [T, H, W, 3] uint8 arrays, their frames already picked) -> ``pixel_values_videos``,
    ``video_grid_thw``: the video processor of an upstream ``Qwen2_5OmniProcessor`` where
    torchvision (which upstream's needs) does not import."""

    def __init__(self, settings: VideoSettings) -> None:
        self.settings = settings
        self.patch_size, self.merge_size = settings.patch_size, settings.merge_size
        self.temporal_patch_size = settings.temporal_patch_size

    def __call__(self, videos: Any, **kwargs: Any) -> dict[str, Tensor]:
        done = [preprocess(torch.as_tensor(np.asarray(v)), self.settings) for v in videos]
        return {
            "pixel_values_videos": torch.cat([patches for patches, _ in done]),
            "video_grid_thw": torch.cat([grid for _, grid in done]),
        }
