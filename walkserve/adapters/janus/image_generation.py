"""Image generation for a Janus checkpoint directory: the ``ImageTask`` of
``/v1/images/generations`` over the ``generate`` walk, its prompt and its pixels made as
upstream's ``JanusProcessor`` (the directory's own) makes them for ``generation_mode="image"``:

    prompt   the processor's chat template over one user message holding the prompt as a text
             part, with the generation prompt (``apply_chat_template``), then the processor
             with ``generation_mode="image"``: BOI appended, tokenized with BOS first, no
             system prompt -> input_ids [1, T] ending with BOI
    pixels   the walk's image [3, H, W] (upstream ``decode_image_tokens``, channels first)
             -> the processor's ``postprocess`` (unnormalize, x 255, clip, truncate to uint8)
             -> [H, W, 3] uint8

The image is passed to ``postprocess`` channels first: in this transformers version the Pillow
backend's ``unnormalize`` reads channels first whatever the layout, so upstream's documented
call on ``decode_image_tokens``' channels-last output raises; on channels-first input both
backends give the same bytes. Guidance, temperature, top-k and top-p are the walk's (the
checkpoint's generation config, ``build.load_janus``); the seed is the request's.

What crosses the boundary: the processor and the model config in, an ``api.profile.ImageTask``
out (None when the processor's postprocess does not make 8-bit images).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from walkserve.api.errors import bad
from walkserve.api.profile import ImageTask

__all__ = ["MAX_PROMPT_TOKENS", "generated_size", "image_task"]

log = logging.getLogger("walkserve")
MAX_PROMPT_TOKENS = 256  # both guidance contexts hold the prompt and the image tokens


def generated_size(config: Any) -> int:
    """The side in pixels of the VQ decoder's images: its token grid side (``num_patches``)
    doubled at each upsampling level (one fewer than ``channel_multiplier``'s levels)."""
    vq = config.vq_config
    return int(vq.num_patches) * 2 ** (len(vq.channel_multiplier) - 1)


def image_task(processor: Any, config: Any, path: str) -> ImageTask | None:
    """The image generation task of the checkpoint at ``path`` (module docstring)."""
    images = processor.image_processor
    if not (images.do_normalize and images.do_rescale):
        log.warning(
            "%s: the image processor's postprocess does not make 8-bit images (do_normalize "
            "and do_rescale off); /v1/images/generations is not served",
            path,
        )
        return None
    specials = [str(processor.image_token), processor.image_start_token, processor.image_end_token]

    def encode(prompt: str) -> list[int]:
        for special in specials:
            if special in prompt:
                raise bad(f"the prompt may not hold {special!r}", "prompt")
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out = processor(text=str(text), generation_mode="image", return_tensors="np")
        return [int(t) for t in out["input_ids"][0]]

    def pixels(image: torch.Tensor) -> torch.Tensor:
        # image [3, H, W] float -> [H, W, 3] uint8
        out = processor.postprocess([image.float()], return_tensors="PIL.Image.Image")
        return torch.from_numpy(np.asarray(out["pixel_values"][0], dtype=np.uint8).copy())

    return ImageTask(
        walk="generate",
        prompt_input="input_ids",
        noise_input=None,
        noise_shape=(),
        size=generated_size(config),
        vocab_size=int(config.text_config.vocab_size),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        image_output="image",
        encode=encode,
        seed_input="seed",
        pixels=pixels,
    )
