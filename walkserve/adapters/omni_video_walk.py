"""``ChatVideo``: the ``chat_video`` walk of both Omni thinkers, mixed into their walks classes
(``qwen25_omni.video_walk``, ``qwen3_omni.video_walk``), which give it three pieces:

    video_placeholders   ``ImagePlaceholders`` of kind "video": one run of the video token per
                         video, t*h*w/merge^2 long (the prompt, unchanged)
    video_positions      the model's upstream ``get_rope_index`` with the videos' grids and
                         seconds a temporal patch -> (position_ids, rope)
    _chat                the thinker's reply to the prompt with the media and those positions

Walk inputs: ``input_ids`` [1, P], ``pixel_values_videos`` [patches, C * T * p * p],
``video_grid_thw`` [videos, 3], ``video_second_per_grid`` [videos] (as upstream's processors make
them: ``omni_video``), ``max_new_tokens`` and the thinker's sampling inputs; outputs as the
model's text chat walks'. No audio out with video: a request asking for it is a 400.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.qwen3_omni.inputs import SEQUENCE
from walkserve.capture import walk

if TYPE_CHECKING:
    from walkserve.adapters.qwen3_omni.inputs import ImagePlaceholders


class VideoRopeIndex(nn.Module):
    """The base of a model's ``video_positions``: upstream ``get_rope_index`` of its thinker on
    a prompt with videos (no images, no audio in the video), shaped by the subclass."""

    def __init__(self, thinker: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "thinker", thinker)  # not a submodule

    def rope_index(self, input_ids: Tensor, grid: Tensor, seconds: Tensor) -> Tensor:
        # input_ids: [B, P], grid: [videos, 3], seconds: [videos] -> [3, B, P] (t / h / w)
        thinker: Any = self.thinker
        ones = torch.ones_like(input_ids)
        positions: Tensor = thinker.get_rope_index(
            input_ids, None, grid, ones, False, None, seconds
        )[0]
        return positions


class ChatVideo:
    """The video walk (see the module docstring)."""

    if TYPE_CHECKING:
        video_placeholders: ImagePlaceholders
        video_positions: nn.Module
        # (input_ids, max_new_tokens, media, sampling, positions) -> the walk's outputs
        _chat: Callable[..., dict[str, Tensor]]

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
        """The thinker's reply to a prompt with videos."""
        input_ids = self.video_placeholders(input_ids, pixel_values_videos, video_grid_thw)
        positions = self.video_positions(input_ids, video_grid_thw, video_second_per_grid)
        media = {"pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw}
        sampling = (temperature, top_p, top_k, seed)
        return self._chat(input_ids, max_new_tokens, media, sampling, positions)
