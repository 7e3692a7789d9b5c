"""Janus image understanding as chat: the ``TextTask`` over the ``chat`` walk and the
``ChatMediaTask`` whose ``image_url`` parts go to ``chat_image``. Each image becomes what
upstream's ``JanusProcessor`` makes of it:

    pixel_values  its image processor (``JanusImageProcessorPil``: the checkpoint's, or one
                  built for a tiny config's image size) -> [1, 3, H, W]
    placeholders  ``<image_placeholder>`` -> BOI, image_token x num_image_tokens, EOI
                  (``JanusProcessor.replace_image_token``)

Up to ``MAX_IMAGES`` images per request (upstream's model scatters the features of all the
request's images into its placeholders in order): ``pixel_values`` [images, 3, H, W] in the
order of the parts. What crosses the
boundary: token ids and sizes from the config, the image processor; out come
``api.profile`` tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from walkserve.api.chatmedia import per_part
from walkserve.api.profile import (
    ChatMediaTask,
    ChatTemplate,
    Decode,
    Encode,
    MediaInputs,
    MediaWalk,
    TextTask,
    plain_chat,
)

MAX_IMAGES = 4  # images per request (each encoded by the vision tower in the prefill)


@dataclass(frozen=True)
class ImageIds:
    """The ids of an image's placeholders: BOI, the image token (``num_image_tokens`` copies),
    EOI."""

    boi: int
    image: int
    eoi: int
    count: int

    def placeholders(self) -> list[int]:
        return [self.boi, *[self.image] * self.count, self.eoi]


def tiny_image_processor(image_size: int) -> Any:
    """Upstream's Janus image processor for a random-weight model's square ``image_size``."""
    from transformers import JanusImageProcessorPil

    return JanusImageProcessorPil(size={"height": image_size, "width": image_size})


def image_inputs(processor: Any, ids: ImageIds) -> MediaInputs:
    """Images [H, W, 3] uint8 -> ``pixel_values`` as upstream's processor calls its image
    processor, and each image's placeholders."""

    def inputs(image: torch.Tensor) -> tuple[dict[str, Any], list[int]]:
        out = processor(
            images=[image.numpy()], input_data_format="channels_last", return_tensors="pt"
        )
        return {"pixel_values": out["pixel_values"]}, ids.placeholders()

    return per_part(inputs)


def chat_tasks(
    encode: Encode,
    decode: Decode,
    eos_id: int,
    vocab_size: int,
    processor: Any,
    ids: ImageIds,
    max_prompt_tokens: int = 512,
    max_tokens: int = 256,
    chat_template: ChatTemplate = plain_chat,
) -> tuple[TextTask, ChatMediaTask]:
    """The text task (``chat``, greedy) and the image chat task (``chat_image``)."""
    text = TextTask(
        walk="chat",
        prompt_input="text_ids",
        max_tokens_input="max_new_tokens",
        tokens_channel="tokens",
        first_token_output=None,
        eos_id=eos_id,
        vocab_size=vocab_size,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens,
        default_max_tokens=min(16, max_tokens),
        encode=encode,
        decode=decode,
        chat_template=chat_template,
    )
    image = MediaWalk("chat_image", image_inputs(processor, ids))
    return text, ChatMediaTask(image=image, max_parts=MAX_IMAGES)
