"""The HTTP profile of a VLM checkpoint: its tokenizer and chat template (as a text LM's,
``hf_causal_lm.checkpoint_profile``), and chat messages with ``image_url`` parts through
``prefill_image``. Each image becomes what the family's upstream processor makes of it:

    qwen2-vl, qwen2.5-vl  the checkpoint's image processor (Qwen2VLImageProcessor*) ->
                          pixel_values, image_grid_thw; placeholders <|vision_start|>
                          <|image_pad|> x t*h*w/merge^2 <|vision_end|> (Qwen2VLProcessor's)
    llava                 its image processor (CLIPImageProcessor*) -> pixel_values;
                          image_grid_thw (1, H/p, W/p); placeholders <image> x (H/p)*(W/p)
                          (+1 with the "full" strategy: LlavaProcessor's expansion)

Up to ``MAX_IMAGES`` images per request, concatenated in the order of their parts. A checkpoint
without an image processor (no ``preprocessor_config.json`` / ``processor_config.json`` with
one) is served for text only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from walkserve.adapters.vlm.families import MODEL_TYPES, Family
from walkserve.api.chatmedia import per_part
from walkserve.api.profile import ChatMediaTask, MediaInputs, MediaWalk, ModelProfile, OneMedia

__all__ = ["MAX_IMAGES", "checkpoint_profile", "image_inputs", "load_image_processor"]

log = logging.getLogger("walkserve")
MAX_IMAGES = 8


def load_image_processor(path: str, config: Any) -> Any | None:
    """The checkpoint's image processor, checked against the vision tower; None without one."""
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        log.warning("%s: no image processor (%s); served for text only", path, e)
        return None
    vision = config.vision_config
    if MODEL_TYPES[str(config.model_type)] == "llava":
        crop = getattr(processor, "crop_size", None) or getattr(processor, "size", None) or {}
        side = (crop.get("height"), crop.get("width"))
        if side != (vision.image_size, vision.image_size):
            raise ValueError(
                f"{path}: the image processor makes images of {side}, the vision tower takes "
                f"{vision.image_size} x {vision.image_size}"
            )
        return processor
    sizes = tuple(
        int(getattr(processor, n)) for n in ("patch_size", "merge_size", "temporal_patch_size")
    )
    tower = (
        int(vision.patch_size),
        int(vision.spatial_merge_size),
        int(vision.temporal_patch_size),
    )
    if sizes != tower:
        raise ValueError(
            f"{path}: the image processor's patch, merge and temporal sizes {sizes} are not the"
            f" vision tower's {tower}"
        )
    return processor


def image_inputs(processor: Any, family: Family) -> MediaInputs:
    """Images [H, W, 3] uint8 -> their walk inputs and each one's placeholders."""
    return per_part(one_image(processor, family))


def one_image(processor: Any, family: Family) -> OneMedia:
    """An image [H, W, 3] uint8 -> its walk inputs and placeholders (module docstring)."""

    def inputs(image: torch.Tensor) -> tuple[dict[str, Any], list[int]]:
        out = processor(
            images=[image.numpy()], input_data_format="channels_last", return_tensors="pt"
        )
        pixels = out["pixel_values"]
        if family.mrope:
            grid = out["image_grid_thw"].to(torch.int64)  # [1, 3]
        else:
            side = int(pixels.shape[-1]) // family.patch
            grid = torch.tensor([[1, int(pixels.shape[-2]) // family.patch, side]])
        count = family.tokens(grid[0])
        ids = [family.image_token] * count
        if family.vision_start is not None and family.vision_end is not None:
            ids = [family.vision_start, *ids, family.vision_end]
        return {"pixel_values": pixels, "image_grid_thw": grid}, ids

    return inputs


def checkpoint_profile(path: str, name: str) -> ModelProfile:
    """The profile of the VLM checkpoint at ``path`` (module docstring)."""
    from transformers import AutoConfig

    from walkserve.adapters.hf_causal_lm import checkpoint_profile as text_profile
    from walkserve.adapters.vlm.families import family_from_config

    profile: ModelProfile = text_profile(path, name)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    processor = load_image_processor(path, config)
    if processor is None or profile.text is None or not profile.text.has_tokenizer:
        return profile
    walk = MediaWalk("prefill_image", image_inputs(processor, family_from_config(config)))
    return dataclasses.replace(profile, chat_media=ChatMediaTask(image=walk, max_parts=MAX_IMAGES))
