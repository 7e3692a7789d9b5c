"""``VideoWalk``: Qwen3-Omni's thinker with videos in the prompt (walk ``chat_video``, text out:
``omni_video_walk.ChatVideo``), mixed into ``Qwen3OmniWalks`` on ``MediaWalks`` (whose
``_think`` it runs):

    chat_video   pixel_values_videos [patches, C * T * p * p], video_grid_thw [videos, 3],
                 video_second_per_grid [videos], as upstream's ``Qwen3OmniMoeProcessor`` makes
                 them (``adapters.omni_video``, its fps 1)

The prompt holds one run of ``<|video_pad|>`` per video, t*h*w/merge^2 long, between
``<|vision_start|>`` and ``<|vision_end|>`` (``ImagePlaceholders`` of kind "video"). The vision
tower runs in the thinker's prefill (upstream ``get_video_features``, its DeepStack features at
the video placeholders: ``decoders.ThinkerOnPool``); positions are upstream ``get_rope_index``
(``VideoMropePositions``), carried into decode as the image walks carry theirs. No audio out
with video: a request asking for it is a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from walkserve.adapters.omni_video_walk import ChatVideo, VideoRopeIndex
from walkserve.adapters.qwen3_omni.media_walks import MediaWalks


class VideoMropePositions(VideoRopeIndex):
    """``MropePositions`` of a prompt with videos -> ``position_ids`` [4, B, P] (the text row,
    then t / h / w) and ``rope`` [B, 2]."""

    def forward(self, input_ids: Tensor, grid: Tensor, seconds: Tensor) -> tuple[Tensor, Tensor]:
        batch, length = input_ids.shape
        mrope = self.rope_index(input_ids, grid, seconds)  # [3, B, P]
        text = torch.arange(length, device=input_ids.device).expand(1, batch, length)
        positions = torch.cat([text, mrope], dim=0)  # [4, B, P]
        return positions, positions[[0, 1], :, -1].t()  # rope: [B, 2]


class VideoWalk(ChatVideo, MediaWalks):
    """``chat_video`` beside the media walks, mixed into ``Qwen3OmniWalks``."""

    def _chat(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        media: Mapping[str, Tensor],
        sampling: tuple[Any, ...],
        positions: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        first, text, _, _ = self._think(
            input_ids, max_new_tokens, media, False, sampling, positions
        )
        return {"first_token": first, "text_tokens": text}
