"""``JanusImageWalks``: the ``generate``, ``understand`` and ``pool_usage`` walks over the
components (package docstring)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.janus.components import (
    LABELS,
    TEXT_LABELS,
    GuidanceKV,
    GuidedSampler,
    ImageDecoder,
    ImageSampling,
    ImageTokenEmbedder,
    KVOpen,
    KVRelease,
    KVUsage,
    PagedLM,
    PoolSize,
    PromptEmbedder,
    PromptIds,
    Seeder,
    TextEmbedder,
    TextHead,
    UnderstandEmbedder,
)
from walkserve.capture import Input, iterations, loop, walk
from walkserve.runtime.kv import hf


class JanusImageWalks(nn.Module):
    """The ``generate`` walk around an upstream ``JanusForConditionalGeneration``. Switches its
    language model's attention to the paged function; everything else runs as upstream."""

    def __init__(
        self,
        janus: Any,  # transformers.JanusForConditionalGeneration
        ids: PromptIds,
        sampling: ImageSampling | None = None,
        pool: PoolSize | None = None,
    ) -> None:
        super().__init__()
        janus.eval().requires_grad_(False)
        language_model = janus.model.language_model
        language_model.config._attn_implementation = hf.register()
        self.kv = GuidanceKV(language_model, pool or PoolSize())
        self.num_image_tokens = int(janus.config.vision_config.num_image_tokens)
        self.kv_open = KVOpen(self.kv, LABELS, ids)
        self.prompt_embedder = PromptEmbedder(janus.get_input_embeddings(), ids)
        self.seeder = Seeder()
        self.lm = PagedLM(language_model, self.kv)
        self.sampler = GuidedSampler(janus.model.generation_head, sampling or ImageSampling())
        self.image_embedder = ImageTokenEmbedder(janus)
        self.kv_release = KVRelease(self.kv)
        self.decoder = ImageDecoder(janus)
        self.kv_usage = KVUsage(self.kv)
        self.eos = int(janus.config.text_config.eos_token_id)
        self.text_open = KVOpen(self.kv, TEXT_LABELS)
        self.understand_embedder = UnderstandEmbedder(janus)
        self.text_head = TextHead(janus.lm_head)
        self.text_embedder = TextEmbedder(janus.get_input_embeddings())

    @walk(inputs={"input_ids": Input(dims={1: "dynamic"})})
    def generate(self, input_ids: Tensor, seed: Tensor) -> dict[str, Tensor]:
        # input_ids: [B, T] int64, ending with BOI; seed: [B] int64
        kv = self.kv_open(input_ids)  # [B]
        embeds = self.prompt_embedder(input_ids)  # [B, 2, T, D]
        rng = self.seeder(seed)  # [B, S]
        tokens = input_ids.new_zeros(input_ids.shape[0], self.num_image_tokens)  # [B, N]
        for _ in range(self.num_image_tokens):
            tokens, embeds, rng = self.image_step(tokens, embeds, rng, kv)
        tokens = self.kv_release(kv, tokens)
        return {"image_tokens": tokens, "image": self.decoder(tokens)}

    @walk(inputs={"text_ids": Input(dims={1: "dynamic"})})
    def understand(
        self, text_ids: Tensor, pixel_values: Tensor, max_new_tokens: int
    ) -> dict[str, Tensor]:
        # text_ids: [B, T] with num_image_tokens image placeholders; pixel_values [B, 3, H, W]
        kv = self.text_open(text_ids)  # [B]: one "text" label each
        embeds = self.understand_embedder(text_ids, pixel_values)  # [B, 1, T, D]
        return {"tokens": self._reply(kv, embeds, max_new_tokens)["released"]}  # [B, n]

    @walk(inputs={"text_ids": Input(dims={1: "dynamic"})})
    def chat(self, text_ids: Tensor, max_new_tokens: int) -> dict[str, Tensor]:
        """Greedy text for a text-only prompt ``text_ids`` [B, T] (``/v1/chat/completions``):
        ``tokens`` streams the reply, ``released`` [B, n] follows once the pages are freed."""
        kv = self.text_open(text_ids)  # [B]
        return self._reply(kv, self.text_embedder(text_ids), max_new_tokens)  # [B, 1, T, D]

    @walk(inputs={"text_ids": Input(dims={1: "dynamic"})})
    def chat_image(
        self, text_ids: Tensor, pixel_values: Tensor, max_new_tokens: int
    ) -> dict[str, Tensor]:
        """``chat`` with an image: ``text_ids`` [B, T] holding BOI, ``num_image_tokens``
        placeholders and EOI as upstream's ``JanusProcessor`` expands ``<image_placeholder>``;
        ``pixel_values`` [B, 3, H, W] from upstream's image processor."""
        kv = self.text_open(text_ids)  # [B]
        embeds = self.understand_embedder(text_ids, pixel_values)  # [B, 1, T, D]
        return self._reply(kv, embeds, max_new_tokens)

    def _reply(self, kv: Tensor, embeds: Tensor, max_new_tokens: int) -> dict[str, Tensor]:
        tokens = []
        for _ in iterations(max_new_tokens):
            embeds, token, done = self.text_step(embeds, kv)
            tokens.append(token)
            if done:
                break
        reply = torch.cat(tokens, dim=1)  # [B, n]: the accumulated channel, streamed
        return {"tokens": reply, "released": self.kv_release(kv, reply)}

    @loop(max_iters="max_new_tokens", speculative=False)
    def text_step(self, embeds: Tensor, kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.lm(kv, embeds)  # [B, 1, D]
        token = self.text_head(hidden)  # [B, 1], greedy
        done = (token == self.eos).all()  # every sequence emitted EOS
        return self.text_embedder(token), token, done

    @walk
    def pool_usage(self, probe: Tensor) -> dict[str, Tensor]:
        # probe: [B], any values -> usage [B, 3]: pages in use, sequences, requests
        return {"usage": self.kv_usage(probe)}

    @loop
    def image_step(
        self, tokens: Tensor, embeds: Tensor, rng: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.lm(kv, embeds)  # [B, 2, D]
        token, rng = self.sampler(hidden, rng)  # [B, 1]
        embeds = self.image_embedder(token)  # [B, 2, 1, D]
        return torch.cat([tokens[:, 1:], token], dim=1), embeds, rng
