"""``VideoWalk``: Qwen2.5-Omni's thinker with videos in the prompt (walk ``chat_video``, text
out), mixed into ``Qwen25OmniWalks`` on ``MediaWalks`` (whose ``_chat`` it runs):

    chat_video   pixel_values_videos [patches, C * T * p * p], video_grid_thw [videos, 3],
                 video_second_per_grid [videos] (seconds one temporal patch spans), as
                 upstream's processor makes them (``adapters.omni_video``)

The prompt holds one run of ``<|VIDEO|>`` per video, t*h*w/merge^2 long, between
``<|vision_bos|>`` and ``<|vision_eos|>`` (``ImagePlaceholders`` of kind "video" checks it).
The vision tower reads the patches inside the thinker's prefill (``PagedThinker``: upstream
``get_video_features``); the rotary positions are upstream ``get_rope_index`` with
``use_audio_in_video=False`` (``VideoRopePositions``: a video's temporal positions step by
``video_second_per_grid * position_id_per_seconds``), carried into decode as the image walks
carry theirs. No audio out with video (no ``speak_video``): a request asking for it is a 400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.qwen3_omni.inputs import SEQUENCE
from walkserve.adapters.qwen25_omni.media_walks import MediaWalks
from walkserve.capture import walk

if TYPE_CHECKING:
    from walkserve.adapters.qwen3_omni.inputs import ImagePlaceholders

VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")


class VideoRopePositions(nn.Module):
    """M-RoPE positions of a prompt with videos: upstream ``get_rope_index`` of the thinker
    (no images, no audio in the video). -> ``position_ids`` [3, B, P] and ``rope`` [B, 1], the
    prompt's largest position (as ``RopePositions``)."""

    def __init__(self, thinker: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "thinker", thinker)  # not a submodule

    def forward(
        self, input_ids: Tensor, video_grid_thw: Tensor, video_second_per_grid: Tensor
    ) -> tuple[Tensor, Tensor]:
        # input_ids: [B, P], video_grid_thw: [videos, 3], video_second_per_grid: [videos]
        thinker: Any = self.thinker
        positions, _ = thinker.get_rope_index(
            input_ids,
            None,
            video_grid_thw,
            torch.ones_like(input_ids),
            False,
            None,
            video_second_per_grid,
        )
        return positions, positions.amax(dim=0).amax(dim=-1, keepdim=True)  # [3, B, P], [B, 1]


class VideoWalk(MediaWalks):
    """The video walk beside the media walks, mixed into ``Qwen25OmniWalks``."""

    if TYPE_CHECKING:
        video_placeholders: ImagePlaceholders
        video_positions: VideoRopePositions

    @walk(inputs={"input_ids": SEQUENCE})
    def chat_video(
        self,
        input_ids: Tensor,
        pixel_values_videos: Tensor,
        video_grid_thw: Tensor,
        video_second_per_grid: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> dict[str, Tensor]:
        """The thinker's reply to a prompt with videos (see the module docstring)."""
        input_ids = self.video_placeholders(input_ids, pixel_values_videos, video_grid_thw)
        positions = self.video_positions(input_ids, video_grid_thw, video_second_per_grid)
        media = {"pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw}
        sampling = (temperature, top_p, top_k, seed)
        return self._chat(input_ids, max_new_tokens, media, sampling, positions)
