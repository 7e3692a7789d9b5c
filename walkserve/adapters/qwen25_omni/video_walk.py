"""``VideoWalk``: Qwen2.5-Omni's thinker with videos in the prompt (walk ``chat_video``, text
out: ``omni_video_walk.ChatVideo``), mixed into ``Qwen25OmniWalks`` on ``MediaWalks`` (whose
``_chat`` it runs):

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

from torch import Tensor

from walkserve.adapters.omni_video_walk import ChatVideo, VideoRopeIndex
from walkserve.adapters.qwen25_omni.media_walks import MediaWalks

VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")


class VideoRopePositions(VideoRopeIndex):
    """M-RoPE positions of a prompt with videos -> ``position_ids`` [3, B, P] and ``rope``
    [B, 1], the prompt's largest position (as ``RopePositions``)."""

    def forward(self, input_ids: Tensor, grid: Tensor, seconds: Tensor) -> tuple[Tensor, Tensor]:
        positions = self.rope_index(input_ids, grid, seconds)  # [3, B, P]
        return positions, positions.amax(dim=0).amax(dim=-1, keepdim=True)  # [B, 1]


class VideoWalk(ChatVideo, MediaWalks):
    """``chat_video`` beside the media walks, mixed into ``Qwen25OmniWalks`` (``MediaWalks``
    gives it ``_chat``)."""
