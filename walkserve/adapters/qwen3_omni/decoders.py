"""Qwen3-Omni's thinker, talker and code predictor on the paged KV pool (``omni_paged``): each
takes the keyword arguments the walks gave the upstream module and builds the decoder input as
upstream's forward does, then runs its base decoder packed with the batch's other calls.

    ThinkerOnPool    input_ids [B, T] (+ input_features / feature_attention_mask,
                     pixel_values / image_grid_thw, or pixel_values_videos / video_grid_thw at
                     a prefill) -> text embeddings with the audio / image / video features at
                     their placeholders (upstream ``get_audio_features``,
                     ``get_image_features``, ``get_video_features``, ``get_placeholder_mask``),
                     DeepStack visual features for the first layers; ``lm_head``
    TalkerOnPool     inputs_embeds [B, T, D] -> ``codec_head``
    PredictorOnPool  a frame's prefill inputs_embeds [B, 2, D] (head 0), then input_ids [B, 1]
                     of residual group g through ``codec_embedding[g - 1]`` (head g)

Rotary positions: a call's ``position_ids`` [4, B, T] (text row, then t / h / w) when the walk
gives them (images, and every decode step), else ``context ..`` in all rows, as upstream's text
model makes them for text and audio prompts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from walkserve.adapters.omni_paged import (
    PagedDecoder,
    PagedThinker,
    Prepared,
    StackOutput,
)
from walkserve.runtime.kv.paged_lm import PagedLMConfig

__all__ = ["PredictorOnPool", "TalkerOnPool", "ThinkerOnPool"]


class ThinkerOnPool(PagedThinker):
    """An upstream ``Qwen3OmniMoeThinkerForConditionalGeneration`` on the pool, with media and
    DeepStack: the image or video features of the first layers added at their placeholders
    (the walks send images or videos, never both: videos go alone)."""

    def prepare(self, args: dict[str, Any], context: int) -> Prepared:
        merged = self.merge_media(args)
        if merged.image is not None and merged.video is not None:
            raise ValueError("a prompt with images and videos: send videos alone")
        visual, out = merged.image_mask, merged.image
        if merged.video is not None:
            visual, out = merged.video_mask, merged.video
        deepstack = None if out is None else [torch.cat(f) for f in out.deepstack_features]
        return Prepared(merged.embeds, args.get("position_ids"), visual, deepstack)


class TalkerOnPool(PagedDecoder):
    """An upstream ``Qwen3OmniMoeTalkerForConditionalGeneration`` (its text model and codec
    head) on the pool; the walks run the code predictor themselves."""

    def __init__(self, talker: Any, config: PagedLMConfig | None = None) -> None:
        super().__init__(talker.model, config)
        self.codec_head = talker.codec_head

    def forward(
        self,
        inputs_embeds: Tensor,
        cache: Any = None,
        use_cache: bool = True,
        position_ids: Tensor | None = None,
        output_hidden_states: bool = False,
        generation_step: int | None = None,  # accepted as upstream's, unused
    ) -> StackOutput:
        return self._call(locals())

    def prepare(self, args: dict[str, Any], context: int) -> Prepared:
        return Prepared(args["inputs_embeds"], args.get("position_ids"))

    def head(self, hidden: Tensor, prepared: Prepared) -> Tensor:
        logits: Tensor = self.codec_head(hidden)
        return logits


class PredictorOnPool(PagedDecoder):
    """An upstream ``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`` on the
    pool: one short sequence per frame (its prefill and ``G - 2`` steps)."""

    def __init__(self, predictor: Any, config: PagedLMConfig | None = None) -> None:
        super().__init__(predictor.model, config)
        self.predictor = predictor

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        generation_steps: int | None = None,
    ) -> StackOutput:
        return self._call(locals())

    def prepare(self, args: dict[str, Any], context: int) -> Prepared:
        embeds = args.get("inputs_embeds")
        if embeds is not None and embeds.shape[1] > 1:  # a frame's prefill: hidden, code 0
            return Prepared(embeds, head=int(embeds.shape[1]) - 2)
        given = args.get("generation_steps")
        step = -1 if given is None else int(given)
        if step < 1:
            raise ValueError(f"a code predictor step needs generation_steps >= 1, got {given!r}")
        table = self.predictor.model.get_input_embeddings()[step - 1]
        return Prepared(table(args["input_ids"]), head=step)

    def head(self, hidden: Tensor, prepared: Prepared) -> Tensor:
        logits: Tensor = self.predictor.lm_head[prepared.head](hidden)
        return logits
