"""Chat messages with audio clips, images and videos for an Omni thinker (Qwen3-Omni's here;
Qwen2.5-Omni's in ``qwen25_omni.profiles``, from the same pieces): the ``ChatMediaTask``
of its profile, over the ``chat_audio`` / ``chat_image`` walks (``speak_audio`` /
``speak_image`` for audio out), ``chat_media`` for both kinds in one request and
``chat_video`` for videos (``omni_video``). The parts
become what upstream's ``Qwen3OmniMoeProcessor`` makes of them:

    audio  WhisperFeatureExtractor features and frame masks of all clips at once (padded to
           the longest, as the processor calls it),
           placeholders <|audio_start|> <|audio_pad|> x audio_token_count(frames) <|audio_end|>
    image  the image processor (``Qwen2VLImageProcessorPil``: the checkpoint's
           ``preprocessor_config.json``, or one built for a tiny config's patch, merge and
           temporal sizes) -> pixel_values, image_grid_thw; placeholders
           <|vision_start|> <|image_pad|> x t*h*w/merge^2 <|vision_end|>

What crosses the boundary: the config's token ids and sizes, the extractor and image
processor (transformers objects); out comes an ``api.profile.ChatMediaTask``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from walkserve.adapters.omni_transcribe import Padding, padding_settings
from walkserve.api.chatmedia import per_part
from walkserve.api.profile import (
    ChatMediaTask,
    FramePicker,
    MediaInputs,
    MediaWalk,
    ModelProfile,
    VideoLimits,
    all_frames,
)

MAX_PARTS = 4  # media parts per request (each clip and image is encoded in the prefill)
TINY_IMAGE_PIXELS = 64 * 64  # the tiny vision tower's images at most (resized by the processor)


def tiny_image_processor(vision_config: Any, max_pixels: int = TINY_IMAGE_PIXELS) -> Any:
    """Upstream's image processor for a tiny config's vision tower (there is no checkpoint
    file): its patch, merge and temporal sizes, images resized to at most ``max_pixels``."""
    from transformers import Qwen2VLImageProcessorPil

    factor = int(vision_config.patch_size * vision_config.spatial_merge_size)
    return Qwen2VLImageProcessorPil(
        patch_size=int(vision_config.patch_size),
        merge_size=int(vision_config.spatial_merge_size),
        temporal_patch_size=int(vision_config.temporal_patch_size),
        size={"shortest_edge": factor * factor, "longest_edge": max_pixels},
    )


def checkpoint_image_processor(path: str, vision_config: Any) -> Any | None:
    """The checkpoint's image processor (``preprocessor_config.json`` with an
    ``image_processor_type``, as Qwen3-Omni's holds beside its feature extractor's fields);
    None without one. ``ValueError`` when its patch, merge or temporal size is not the vision
    tower's."""
    from transformers import Qwen2VLImageProcessorPil

    file = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        if "image_processor_type" not in json.load(f):
            return None
    processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    sizes = (processor.patch_size, processor.merge_size, processor.temporal_patch_size)
    tower = (
        vision_config.patch_size,
        vision_config.spatial_merge_size,
        vision_config.temporal_patch_size,
    )
    if tuple(map(int, sizes)) != tuple(map(int, tower)):
        raise ValueError(
            f"{file}: the image processor's patch, merge and temporal sizes {sizes} are not the"
            f" vision tower's {tower}"
        )
    return processor


def image_inputs(processor: Any, start: int, pad: int, end: int) -> MediaInputs:
    """Images [H, W, 3] uint8 -> ``pixel_values``, ``image_grid_thw`` as upstream's processor
    calls its image processor (each image alone: the same patches), and each one's
    placeholders."""
    merge = int(processor.merge_size)

    def inputs(image: torch.Tensor) -> tuple[dict[str, Any], list[int]]:
        out = processor(
            images=[image.numpy()], input_data_format="channels_last", return_tensors="pt"
        )
        grid = out["image_grid_thw"]  # [1, 3]
        count = int(grid.prod()) // merge**2
        media = {"pixel_values": out["pixel_values"], "image_grid_thw": grid.to(torch.int64)}
        return media, [start, *[pad] * count, end]

    return per_part(inputs)


def audio_inputs(
    extractor: Any,
    start: int,
    pad: int,
    end: int,
    count: Callable[[torch.Tensor], torch.Tensor],
    padding: Padding = True,
) -> MediaInputs:
    """Clips [samples] at the extractor's rate -> ``input_features`` [clips, mel, T],
    ``feature_attention_mask`` [clips, T] (the extractor called on all of them at once, as
    upstream's processor calls it: ``padding`` True pads to the longest, as Qwen3-Omni's
    does; "max_length" to the extractor's 30 s, as Qwen2.5-Omni's does) and each clip's
    placeholders, ``count(frames)`` [clips] of them."""
    settings = padding_settings(padding)  # max_audio_seconds keeps clips within the chunk

    def inputs(clips: list[torch.Tensor]) -> tuple[dict[str, Any], list[list[int]]]:
        out = extractor(
            [clip.numpy() for clip in clips],
            sampling_rate=extractor.sampling_rate,
            return_attention_mask=True,
            return_tensors="pt",
            **settings,
        )
        mask = out["attention_mask"].to(torch.int64)  # [clips, T]
        counts = count(mask.sum(-1)).tolist()
        media = {"input_features": out["input_features"], "feature_attention_mask": mask}
        return media, [[start, *[pad] * int(n), end] for n in counts]

    return inputs


def with_qwen3_chat_media(
    profile: ModelProfile,
    config: Any,
    extractor: Any | None,
    image_processor: Any | None,
    max_audio_seconds: float,
    video_settings: Any | None = None,
    video_limits: VideoLimits | None = None,
) -> ModelProfile:
    """``profile`` (a Qwen3-Omni profile) whose chat takes audio clips (with an extractor),
    images (with an image processor) and videos (with ``omni_video.VideoSettings``), up to
    ``MAX_PARTS`` per request, clips and images in one request through ``chat_media`` (text
    out only: no ``speak_media``, see its module), videos alone through ``chat_video`` (text
    out); ``config`` its ``Qwen3OmniMoeConfig``."""
    from walkserve.adapters import omni_video

    thinker = config.thinker_config
    audio = image = video = None
    frames: FramePicker = all_frames
    if video_settings is not None:
        placeholders = (
            int(thinker.vision_start_token_id),
            int(thinker.video_token_id),
            int(thinker.vision_end_token_id),
        )
        video = MediaWalk("chat_video", omni_video.video_inputs(video_settings, *placeholders))
        frames = omni_video.pick_frames(video_settings)
    if extractor is not None:
        from walkserve.adapters.qwen3_omni import audio_token_count

        n_window = int(thinker.audio_config.n_window)
        audio = MediaWalk(
            "chat_audio",
            audio_inputs(
                extractor,
                int(thinker.audio_start_token_id),
                int(thinker.audio_token_id),
                int(thinker.audio_end_token_id),
                lambda frames: audio_token_count(frames, n_window),
            ),
            speak_walk="speak_audio",
        )
    if image_processor is not None:
        image = MediaWalk(
            "chat_image",
            image_inputs(
                image_processor,
                int(thinker.vision_start_token_id),
                int(thinker.image_token_id),
                int(thinker.vision_end_token_id),
            ),
            speak_walk="speak_image",
        )
    rate = int(extractor.sampling_rate) if extractor is not None else 16000
    return with_chat_media(
        profile,
        audio,
        image,
        rate,
        max_audio_seconds,
        video=video,
        video_frames=frames,
        video_limits=video_limits,
    )


def with_chat_media(
    profile: ModelProfile,
    audio: MediaWalk | None,
    image: MediaWalk | None,
    sample_rate: int,
    max_audio_seconds: float,
    mixed_speak_walk: str | None = None,
    video: MediaWalk | None = None,
    video_frames: FramePicker = all_frames,
    video_limits: VideoLimits | None = None,
) -> ModelProfile:
    """``profile`` whose chat takes the media of ``audio`` / ``image`` / ``video`` (None: that
    kind is a 400), up to ``MAX_PARTS`` per request, audio and images in one request through
    ``chat_media`` (``mixed_speak_walk`` for audio out; None: a 400), videos alone (the frames
    ``video_frames`` picks, under ``video_limits``); ``profile`` unchanged with none."""
    if audio is None and image is None and video is None:
        return profile
    task = ChatMediaTask(
        audio=audio,
        image=image,
        sample_rate=sample_rate,
        max_audio_seconds=max_audio_seconds,
        max_parts=MAX_PARTS,
        video=video,
        video_frames=video_frames,
        video_limits=video_limits or VideoLimits(),
        mixed_walk="chat_media" if audio is not None and image is not None else None,
        mixed_speak_walk=mixed_speak_walk if audio is not None and image is not None else None,
    )
    return dataclasses.replace(profile, chat_media=task)
