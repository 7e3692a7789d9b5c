"""The upstream pipelines' own images, the reference the SD3 walks (``diffusers_dit``) are
checked against in the tests and timed against in the image benchmark: ``pipeline_image`` is
``StableDiffusion3Pipeline``'s image for a request (the arguments ``request_inputs`` takes),
``pipeline_edit_image`` is ``StableDiffusion3Img2ImgPipeline``'s, on the same parts, for an edit
(those ``edit_inputs`` takes); both with ``output_type="pt"`` and a seeded CPU
``torch.Generator``, as the walks' inputs are drawn. The walks never call them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from walkserve.adapters.diffusers_dit import SD3Walks, native_size

__all__ = ["pipeline_edit_image", "pipeline_image"]


def pipeline_image(walks: SD3Walks, inputs: dict[str, Any], prompt: str, **kw: Any) -> Tensor:
    """The upstream pipeline's own image for a request (``output_type="pt"``), for tests and
    the benchmark baseline. ``kw``: negative_prompt, seed, steps, guidance_scale, size."""
    pipe = walks.host.pipe
    size = kw.get("size") or native_size(walks)
    out = pipe(
        prompt,
        negative_prompt=kw.get("negative_prompt", ""),
        num_inference_steps=kw.get("steps", 4),
        guidance_scale=kw.get("guidance_scale", 5.0),
        height=size,
        width=size,
        generator=torch.Generator().manual_seed(kw.get("seed", 0)),
        output_type="pt",
        max_sequence_length=walks.shapes.t5_len,
    )
    return out.images  # type: ignore[no-any-return]


def pipeline_edit_image(walks: SD3Walks, prompt: str, image: Tensor, **kw: Any) -> Tensor:
    """``StableDiffusion3Img2ImgPipeline`` (on the same parts) for ``image`` [1, 3, H, W] in
    [0, 1]; ``kw``: negative_prompt, seed, steps, strength, guidance_scale."""
    from diffusers import StableDiffusion3Img2ImgPipeline

    pipe: Any = StableDiffusion3Img2ImgPipeline(**walks.host.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt,
        image=image,
        negative_prompt=kw.get("negative_prompt", ""),
        num_inference_steps=kw.get("steps", 4),
        strength=kw.get("strength", 0.6),
        guidance_scale=kw.get("guidance_scale", 5.0),
        height=image.shape[2],
        width=image.shape[3],
        generator=torch.Generator().manual_seed(kw.get("seed", 0)),
        output_type="pt",
        max_sequence_length=walks.shapes.t5_len,
    )
    return out.images  # type: ignore[no-any-return]
