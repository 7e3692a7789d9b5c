"""Video parts for the Omni thinkers (``adapters.omni_video``) against upstream, reached without
torchvision (which cannot import beside this torch build, and which upstream's
``Qwen2VLVideoProcessor`` module imports first): its own ``sample_frames`` and ``patchify``,
read from its source file and run as they are written, and its image processor (a frame is a
video of one temporal patch: the image repeated); where torchvision imports, the whole
upstream video processor. And the uploads (``api.videocodec``): frames and rates of mp4, webm,
matroska files, and every limit and bad file a ``ValueError`` naming it."""

from __future__ import annotations

import ast
import math
import types
from typing import Any

import numpy as np
import pytest
import torch

from walkserve.adapters import omni_video
from walkserve.api import videocodec
from walkserve.api.profile import VideoLimits, all_frames

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = omni_video.VideoSettings(
    patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=32 * 32
)


def upstream_method(name: str) -> Any:
    """``Qwen2VLVideoProcessor.<name>`` compiled from upstream's source file (its module
    cannot be imported without torchvision; the method itself needs only torch)."""
    from transformers.models import qwen2_vl
    from transformers.video_utils import VideoMetadata

    path = qwen2_vl.__path__[0] + "/video_processing_qwen2_vl.py"
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Processor"))
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict[str, Any] = {"torch": torch, "math": math, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), scope)
    return scope[name]


@pytest.mark.parametrize(
    ("total", "video_fps"),
    [(4, 2.0), (5, 2.0), (30, 30.0), (300, 30.0), (61, 24.0), (7, 1.0), (9000, 25.0), (3, 30.0)],
)
def test_frames_are_upstream_sample_frames_at_the_processor_fps(
    total: int, video_fps: float
) -> None:
    from transformers.video_utils import VideoMetadata

    sample = upstream_method("sample_frames")
    me = types.SimpleNamespace(
        num_frames=None,
        fps=None,
        temporal_patch_size=TINY.temporal_patch_size,
        min_frames=TINY.min_frames,
        max_frames=TINY.max_frames,
    )
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    want = sample(me, meta, fps=TINY.fps).tolist()
    assert omni_video.pick_frames(TINY)(total, video_fps) == want
    assert len(want) % TINY.temporal_patch_size == 0


def test_a_video_shorter_than_a_temporal_patch_is_refused() -> None:
    with pytest.raises(ValueError, match="the video has 1 frames; the model reads at least 2"):
        omni_video.pick_frames(TINY)(1, 2.0)


@pytest.mark.parametrize("frames", [4, 5, 1])
def test_the_patch_layout_is_upstream_patchify(frames: int) -> None:
    """Random frames (odd counts padded with the last frame) through upstream's ``patchify``
    and ours: the same patches, the same grid."""
    patchify = upstream_method("patchify")
    g = torch.Generator().manual_seed(frames)
    video = torch.randn(frames, 3, 16, 24, generator=g)
    want, *grid = patchify(None, video[None], 4, 2, 2)
    got, got_grid = omni_video.patchify(video, TINY)
    assert got_grid == grid
    assert torch.equal(got, want[0])


def image_processor(settings: omni_video.VideoSettings) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=settings.patch_size,
        merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size,
        size={"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
    )


@pytest.mark.parametrize(("height", "width", "lsb"), [(16, 24, 0), (40, 56, 1), (6, 7, 1)])
def test_two_identical_frames_are_the_image_processor_on_one(
    height: int, width: int, lsb: int
) -> None:
    """A video of a frame twice is one temporal patch, as upstream's image processor makes of
    the frame (it repeats an image to the temporal patch). Frames already of the patch
    grid's size are not resized: equal to float rounding; resized ones (both sides down, or
    both up) differ by at most one uint8 step where torch's antialiased bicubic and Pillow's
    round apart (one side down and one up, torch and Pillow part further: that is upstream's
    image processor (Pillow) against its video processor (torch), not ours)."""
    g = torch.Generator().manual_seed(height)
    frame = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    want = image_processor(TINY)(images=[frame.numpy()], return_tensors="pt")
    patches, grid = omni_video.preprocess(torch.stack([frame, frame]), TINY)
    assert torch.equal(grid, want["image_grid_thw"])
    step = 1 / (255 * min(TINY.std))  # one uint8 step after normalizing
    diff = (patches - want["pixel_values"]).abs()
    assert diff.max().item() <= lsb * step + 1e-5
    assert (diff > 1e-5).float().mean().item() < 0.05  # nearly all equal


def test_where_torchvision_imports_the_upstream_video_processor_is_ours() -> None:
    from transformers.utils import is_torchvision_v2_available

    if not is_torchvision_v2_available():
        pytest.skip("torchvision does not import beside this torch build (torchvision::nms)")
    processor = omni_video.upstream_video_processor(TINY)
    g = torch.Generator().manual_seed(3)
    frames = torch.randint(0, 256, (5, 40, 56, 3), generator=g, dtype=torch.uint8)
    want = processor(videos=[frames.numpy()], return_tensors="pt")
    patches, grid = omni_video.preprocess(frames, TINY)
    assert torch.equal(grid, want["video_grid_thw"])
    torch.testing.assert_close(patches, want["pixel_values_videos"], rtol=0, atol=1e-5)


def video(frames: int, size: tuple[int, int] = (24, 32), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, *size, 3), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize(("fmt", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx"), ("avi", "mpeg4")])
def test_uploads_decode_to_the_picked_frames(fmt: str, codec: str) -> None:
    data = videocodec.encode(video(9), 3, fmt, codec)
    out = videocodec.decode(data, VideoLimits(), lambda total, fps: [1, 4, total - 1])
    assert (out.total_frames, out.fps, out.indices) == (9, 3.0, (1, 4, 8))
    assert out.frames.shape == (3, 24, 32, 3) and out.frames.dtype == torch.uint8


def test_a_lossless_upload_decodes_to_its_frames() -> None:
    frames = video(4)
    out = videocodec.decode(
        videocodec.encode(frames, 2, "matroska", "ffv1"), VideoLimits(), all_frames
    )
    assert torch.equal(out.frames, frames)


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        (VideoLimits(max_bytes=100), r"the video has \d+ bytes; the limit is 100 bytes"),
        (VideoLimits(max_frames=8), "more than 8 frames; the limit is 8"),
        (VideoLimits(max_seconds=2.5), r"the video is \d.* s long; the limit is 2.5 s"),
        (VideoLimits(max_pixels=24 * 31), r"24 = 768 pixels; the limit is 744 pixels a frame"),
    ],
)
def test_each_limit_is_a_value_error_naming_it(limits: VideoLimits, match: str) -> None:
    data = videocodec.encode(video(9), 3)  # 3 s of 32x24
    with pytest.raises(ValueError, match=match):
        videocodec.decode(data, limits, all_frames)


def test_bad_files_are_value_errors() -> None:
    from walkserve.api import audiocodec

    good = videocodec.encode(video(6), 3)
    cases = [
        (b"", "the video file is empty"),
        (b"\x00\x01not a video at all" * 20, "not a video that can be read"),
        (good[: len(good) // 3], "video"),
        (audiocodec.encode(torch.zeros(1600), "wav", 16000), "'wav' container is not accepted"),
        (audiocodec.encode(torch.zeros(1600), "opus", 16000), "container is not accepted"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            videocodec.decode(data, VideoLimits(), all_frames)
    with pytest.raises(ValueError, match="picks frames"):
        videocodec.decode(good, VideoLimits(), lambda total, fps: [0, total])


def test_video_inputs_are_one_videos_patches_grid_and_placeholders() -> None:
    frames = video(6, (40, 56))
    clip = videocodec.Video(frames, 3.0, 6, tuple(range(6)))
    inputs, ids = omni_video.video_inputs(TINY, 7, 8, 9)([clip, clip])
    patches, grid = omni_video.preprocess(frames, TINY)
    assert torch.equal(inputs["pixel_values_videos"], torch.cat([patches, patches]))
    assert inputs["video_grid_thw"].tolist() == [grid[0].tolist()] * 2
    assert inputs["video_second_per_grid"].tolist() == [1.0, 1.0]  # temporal patch / 2 fps
    count = int(grid.prod()) // 4
    assert ids == [[7, *[8] * count, 9]] * 2 and grid[0, 0] == 3  # 6 frames, temporal patch 2
    assert np.isfinite(patches.numpy()).all()
