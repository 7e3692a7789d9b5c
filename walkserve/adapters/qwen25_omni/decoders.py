"""Qwen2.5-Omni's thinker and talker on the paged KV pool (``omni_paged``), called as the walks
called the upstream modules:

    ThinkerOnPool   input_ids [B, T] (+ input_features / feature_attention_mask, or
                    pixel_values / image_grid_thw at a prefill: ``PagedThinker`` merges them as
                    upstream's forward does) -> ``lm_head``; with ``output_hidden_states`` the
                    text model's hidden states (the walks read the embeddings' and the last
                    layer's)
    TalkerOnPool    a prefill's inputs_embeds [B, T, D_thinker], or a step's input_ids [B, 1]
                    (codec embedding + the first of ``thinker_reply_part``, as upstream's
                    forward adds them) -> ``thinker_to_talker_proj``; ``codec_head`` in float

Positions: a call's ``position_ids`` [3, B, T] (M-RoPE t / h / w) when the walk gives them (the
media walks), else ``context ..`` in all three rows, as upstream makes them for text without
an attention mask (``speak`` gives none: ``generate()`` gives the talker none either).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from walkserve.adapters.omni_paged import PagedDecoder, PagedThinker, Prepared, StackOutput
from walkserve.runtime.kv.paged_lm import PagedLMConfig

__all__ = ["TalkerOnPool", "ThinkerOnPool"]


class ThinkerOnPool(PagedThinker):
    """An upstream ``Qwen2_5OmniThinkerForConditionalGeneration`` on the pool."""


class TalkerOnPool(PagedDecoder):
    """An upstream ``Qwen2_5OmniTalkerForConditionalGeneration`` on the pool."""

    def __init__(self, talker: Any, config: PagedLMConfig | None = None) -> None:
        super().__init__(talker.model, config)
        self.talker = talker

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        thinker_reply_part: Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
    ) -> StackOutput:
        return self._call(locals())

    def prepare(self, args: dict[str, Any], context: int) -> Prepared:
        embeds = args.get("inputs_embeds")
        if embeds is None:  # a step: the code's embedding plus the thinker's reply part
            reply = args.get("thinker_reply_part")
            if reply is None:
                raise ValueError("a talker step takes input_ids and thinker_reply_part")
            embeds = self.talker.get_input_embeddings()(args["input_ids"]) + reply[:, :1]
        return Prepared(self.talker.thinker_to_talker_proj(embeds))

    def head(self, hidden: Tensor, prepared: Prepared) -> Tensor:
        logits: Tensor = self.talker.codec_head(hidden).float()
        return logits
