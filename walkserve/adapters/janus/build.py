"""Random-weight Janus models, their sample inputs and HTTP profile, and the checkpoint loader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from walkserve.adapters.janus.components import ImageSampling, PoolSize, PromptIds
from walkserve.adapters.janus.walks import JanusImageWalks

TINY_VOCAB = 320  # byte ids 3..258 (ByteTokenizer), image placeholder 300, BOI 301, EOI 302
TINY_IDS = PromptIds(bos=1, boi=301, pad=0)
TINY_IMAGE_TOKEN = 300
TINY_EOI = 302
TINY_EOS = 2


@dataclass(frozen=True)
class JanusSize:
    """The knobs of a random-weight Janus: text model width/depth, image grid, VQ codebook."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    image_size: int = 64  # pixels; the image-token grid is image_size // 16 per side
    codebook: int = 256


TINY = JanusSize()
SMALL = JanusSize(hidden=512, layers=8, heads=8, kv_heads=4, image_size=128, codebook=1024)


def random_janus(size: JanusSize = TINY, seed: int = 0) -> nn.Module:
    """A random-weight ``JanusForConditionalGeneration`` (the facts.md tiny recipe, scaled by
    ``size``): ``(image_size // 16) ** 2`` image tokens from a ``codebook``-entry VQ."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    torch.manual_seed(seed)
    config = JanusConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": TINY_VOCAB,
            "hidden_size": size.hidden,
            "intermediate_size": 2 * size.hidden,
            "num_hidden_layers": size.layers,
            "num_attention_heads": size.heads,
            "num_key_value_heads": size.kv_heads,
            "max_position_embeddings": 1024,
            "bos_token_id": TINY_IDS.bos,
            "eos_token_id": TINY_EOS,
            "pad_token_id": TINY_IDS.pad,
            "initializer_range": 0.15,  # varied greedy text from random tied embeddings
        },
        vision_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": size.image_size,
            "patch_size": 16,
            "projection_dim": size.hidden,
            "num_image_tokens": (size.image_size // 16) ** 2,
            "depth": 1,
            "mlp_ratio": 2.0,
        },
        vq_config={
            "embed_dim": 8,
            "num_embeddings": size.codebook,
            "base_channels": 32,
            "latent_channels": 16,
            "num_res_blocks": 1,
            "projection_dim": size.hidden,
            "image_token_embed_dim": size.hidden,
            "num_hidden_layers": 1,
        },
        image_token_id=TINY_IMAGE_TOKEN,
    )
    return JanusForConditionalGeneration(config).eval()


def tiny_janus(seed: int = 0) -> nn.Module:
    """The tiny model of the tests: 64x64 images of 16 tokens, hidden 64, 2 layers."""
    return random_janus(TINY, seed)


def sample_inputs(
    prompt: Sequence[int] = (40, 50, 60), size: JanusSize | None = None
) -> dict[str, Any]:
    """Inputs of every walk (``generate``, ``understand``, ``pool_usage``) for the random-weight
    models of ``size`` (default: tiny)."""
    ids = [TINY_IDS.bos, *prompt, TINY_IDS.boi]
    return {
        "input_ids": torch.tensor([ids]),
        "seed": torch.tensor([0]),
        "probe": torch.zeros(1),
        **understand_inputs(prompt, size),
    }


def understand_inputs(
    prompt: Sequence[int] = (40, 50, 60), size: JanusSize | None = None, max_new_tokens: int = 8
) -> dict[str, Any]:
    """Inputs of the ``understand`` walk: BOS, the image placeholders, the prompt; a seeded
    random image in [-1, 1]."""
    size = size or TINY
    n_image = (size.image_size // 16) ** 2
    ids = [TINY_IDS.bos, *[TINY_IMAGE_TOKEN] * n_image, *prompt]
    g = torch.Generator().manual_seed(len(prompt))
    pixels = torch.rand(1, 3, size.image_size, size.image_size, generator=g) * 2 - 1
    return {
        "text_ids": torch.tensor([ids]),
        "pixel_values": pixels,
        "max_new_tokens": max_new_tokens,
    }


def tiny(seed: int = 0) -> tuple[JanusImageWalks, dict[str, Any]]:
    """Zero-argument factory for ``serve("walkserve.adapters.janus:tiny")``."""
    return JanusImageWalks(tiny_janus(seed), TINY_IDS), sample_inputs()


def api_profile(name: str) -> Any:
    """What ``/v1/images/generations`` and ``/v1/chat/completions`` (text, one image) need for
    the random-weight models (``api.profile`` calls this for ``walkserve.adapters.janus:tiny``
    and ``:small``): the toy byte tokenizer, wrapped in BOS ... BOI for images."""
    from walkserve.adapters.janus.chat import ImageIds, chat_tasks, tiny_image_processor
    from walkserve.adapters.tokenizer import ByteTokenizer
    from walkserve.api.profile import ImageTask, ModelProfile

    tok = ByteTokenizer(TINY_IDS.boi - 1)  # bytes lossless below the image specials

    def encode(text: str) -> list[int]:
        return [TINY_IDS.bos, *tok.encode(text), TINY_IDS.boi]

    size = SMALL if name.endswith(":small") else TINY
    task = ImageTask(
        walk="generate",
        prompt_input="input_ids",
        noise_input=None,
        noise_shape=(),
        size=size.image_size,
        vocab_size=TINY_VOCAB,
        max_prompt_tokens=256,
        image_output="image",
        encode=encode,
        seed_input="seed",
    )
    ids = ImageIds(TINY_IDS.boi, TINY_IMAGE_TOKEN, TINY_EOI, (size.image_size // 16) ** 2)

    def decode(ids: list[int]) -> str:  # ids past the bytes are specials: skipped
        return tok.decode([i for i in ids if i < tok.specials + 256])

    text, media = chat_tasks(
        tok.encode, decode, TINY_EOS, TINY_VOCAB, tiny_image_processor(size.image_size), ids
    )
    return ModelProfile(name, text=text, image=task, chat_media=media)


def small() -> tuple[JanusImageWalks, dict[str, Any]]:
    """Zero-argument factory of the benchmark model: a ~35M-parameter text model (hidden 512,
    8 layers), 128x128 images of 64 tokens."""
    return JanusImageWalks(random_janus(SMALL), TINY_IDS), sample_inputs(size=SMALL)


def load_janus(
    path: str, sampling: ImageSampling | None = None, pool: PoolSize | None = None
) -> tuple[JanusImageWalks, dict[str, Any]]:
    """A local Janus checkpoint directory (``from_pretrained`` on a path, safetensors). BOS,
    PAD and BOI come from its generation config, as upstream ``generate`` reads them, and so do
    the guidance scale, temperature, top-k and top-p that it sets (unset: upstream's defaults,
    ``ImageSampling``'s). Images are always sampled, as upstream's docs call ``generate`` with
    ``do_sample=True``; ``sampling`` replaces all of these."""
    from transformers import JanusForConditionalGeneration

    janus = JanusForConditionalGeneration.from_pretrained(path, local_files_only=True)
    gen = janus.generation_config
    boi = (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id")
    if boi is None or gen.bos_token_id is None or gen.pad_token_id is None:
        raise ValueError(
            f"{path}: generation_config.json needs bos_token_id, pad_token_id and "
            "generation_kwargs.boi_token_id for image generation"
        )
    if sampling is None:
        knobs = ("guidance_scale", "temperature", "top_k", "top_p")
        sampling = ImageSampling(
            **{k: getattr(gen, k) for k in knobs if getattr(gen, k, None) is not None}
        )
    ids = PromptIds(bos=int(gen.bos_token_id), boi=int(boi), pad=int(gen.pad_token_id))
    walks = JanusImageWalks(janus, ids, sampling, pool)
    vision: Any = janus.config.vision_config
    placeholders = [int(janus.config.image_token_id)] * int(vision.num_image_tokens)
    return walks, {
        "input_ids": torch.tensor([[ids.bos, ids.boi]]),
        "seed": torch.tensor([0]),
        "probe": torch.zeros(1),
        "text_ids": torch.tensor([[ids.bos, *placeholders]]),
        "pixel_values": torch.zeros(1, 3, vision.image_size, vision.image_size),
        "max_new_tokens": 2,
    }
