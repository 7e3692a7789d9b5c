"""``VLMWalks``: the text walks of ``hf_causal_lm.TextWalks`` (``prefill`` -> ``decode``,
``prefill_ext`` -> ``decode_ext``) over a vision-language model's LM on the pool
(``paged.PagedVLM``), and ``prefill_image`` -> ``decode`` for prompts with images:

    prefill_image(input_ids [1, P], pixel_values, image_grid_thw [images, 3], sampling...)
        features, image_keys = vision(pixel_values, image_grid_thw)   # VisionTower component
        token, cache = lm(input_ids, ..., image_features=features, image_keys, image_grid_thw)
        -> token, cache, count                                        # then the text decode

The prompt holds each image's placeholder tokens (``families.Family.tokens`` of its grid row)
where the image is, as the family's processor lays them out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from walkserve.adapters.hf_causal_lm import TextWalks
from walkserve.adapters.vlm.encoder import DEFAULT_CACHE_BYTES, VisionTower
from walkserve.adapters.vlm.families import Family, family_of
from walkserve.adapters.vlm.paged import PagedVLM
from walkserve.capture import Input, register_component, walk
from walkserve.runtime.kv.grammar import Vocabulary
from walkserve.runtime.kv.hf_attention import UnsupportedAttention, text_config
from walkserve.runtime.kv.paged_lm import PagedLMConfig

__all__ = ["VLMWalks", "sample_request"]

register_component(PagedVLM, engine="kv_cache")
register_component(VisionTower, engine="stateless")


class VLMWalks(TextWalks, nn.Module):
    """Walks around ``model`` (an upstream VLM of a ``families`` family)."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_id: int,
        kv: PagedLMConfig | None = None,
        vocabulary: Vocabulary | None = None,
        encoder_cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        super().__init__()
        family = family_of(model)
        tower = family.tower(model)
        own = [(c, c._attn_implementation) for c in _configs(tower)]
        if any(c is text_config(model) for c, _ in own):
            raise UnsupportedAttention(
                f"{type(model).__name__}: its vision tower reads the LM's config"
            )
        self.lm = PagedVLM(model, family, kv, stop_ids=(eos_token_id,), vocabulary=vocabulary)
        self.vision = VisionTower(model, family, encoder_cache_bytes, attention=own)
        self.family: Family = family
        self.eos = eos_token_id

    @walk(
        next="decode",
        state=("cache", "count"),
        inputs={"input_ids": Input(vocab=lambda m: m.lm.lm.get_input_embeddings().num_embeddings)},
    )
    def prefill_image(
        self,
        input_ids,  # [1, P]
        pixel_values,
        image_grid_thw,  # [images, 3]
        temperature,
        top_p,
        top_k,
        seed,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
    ):
        features, keys = self.vision(pixel_values, image_grid_thw)
        token, cache = self.lm(
            input_ids, None, 0, temperature, top_p, top_k, seed, repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            min_tokens=min_tokens, image_features=features, image_keys=keys,
            image_grid_thw=image_grid_thw,
        )  # fmt: skip
        return {"token": token, "cache": cache, "count": torch.ones_like(token)}  # [1, 1]

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        return super().next_walk(request, "prefill" if walk == "prefill_image" else walk, outputs)


def _configs(module: nn.Module) -> list[Any]:
    """The distinct configs the modules of ``module`` read."""
    seen: dict[int, Any] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def sample_request(model: nn.Module, max_new_tokens: int = 4) -> dict[str, Any]:
    """Capture's sample: a short prompt with one small image (and the text walks' inputs)."""
    from walkserve.adapters.hf_causal_lm import sample_request as text_request

    family = family_of(model)
    pixels, grid = family.sample_image(model)
    ids = [1, *[family.image_token] * family.tokens(grid[0]), 2, 3]
    request = text_request(ids, max_new_tokens)
    request.update(pixel_values=pixels, image_grid_thw=grid)
    return request
