"""The prefix: PaliGemma (unmodified, from transformers) over the cameras' images, the prompt
and the discretised robot state, run once per observation; its per-layer keys and values are
what the action expert attends to at every flow step.

    images     [B, C, 3, S, S] float in [-1, 1]   C cameras, S the vision tower's image size
    prompt_ids [B, L] int64                        L <= max_prompt_len; padded (pad_prompt);
                                                   the pad id (0) marks padding anywhere
    state      [B, state_dim] float                normalised to [-1, 1] (clamped outside)
    -> prefix_k, prefix_v [layers, B, kv_heads, P, head_dim]   keys RoPE-rotated
       prefix_mask        [B, P] bool                          False at padding

    prefix = [ cam 0 tokens | ... | cam C-1 tokens | prompt (+ pad) | state tokens ]
             SigLIP + projector (PaliGemma)          Gemma embedding (scaled by sqrt(D))

pi0.5 writes the discretised state into the prompt (the bin numbers as text, tokenized); here
each state value is one token whose id is its bin among the vocabulary's last ``state_bins``
ids (the range pi0-FAST also takes for its action tokens), so the whole prefix is built from
tensors. The attention inside the prefix is bidirectional over valid tokens
(``attention.block_causal_mask``, one block), so every prefix key depends on the state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PaliGemmaModel

from walkserve.adapters.pi05.attention import block_causal_mask, positions
from walkserve.adapters.pi05.config import Pi05Config
from walkserve.capture.api import component
from walkserve.capture.gluefn import glue_function


@glue_function
def pad_prompt(prompt_ids: Tensor, length: int, pad_id: int) -> Tensor:
    """prompt_ids [B, L] -> [B, length], padded at the end with ``pad_id``; a prompt longer
    than ``length`` is refused (never cut). The ``act`` walk pads before the prefix encoder,
    so that prompts of any length give prefixes of one shape, which batch."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] > length:
        raise ValueError(
            f"prompt_ids must be [B, L] token ids with L <= {length}, got {list(prompt_ids.shape)}"
        )
    return F.pad(prompt_ids, (0, length - prompt_ids.shape[1]), value=pad_id)


def discretise_state(state: Tensor, bins: int) -> Tensor:
    """state [B, D] float -> [B, D] int64 bin in [0, bins): ``bins`` equal bins over [-1, 1],
    values outside clamped to the first or last bin."""
    return ((state + 1.0) * (bins / 2.0)).floor().clamp(0, bins - 1).long()


@component(engine="stateless")
class PrefixEncoder(nn.Module):
    """images, prompt_ids, state -> prefix_k, prefix_v, prefix_mask (see the module
    docstring): PaliGemma's vision tower and projector embed the images, its Gemma embeds
    the prompt and state tokens, and one Gemma forward over the prefix (a custom 4D mask:
    bidirectional, padding masked) leaves every layer's keys and values in its cache."""

    def __init__(self, paligemma: PaliGemmaModel, cfg: Pi05Config) -> None:
        super().__init__()
        cfg.check_backbone(paligemma.config)
        self.paligemma = paligemma
        self.cfg = cfg
        text: Any = paligemma.config.text_config
        vision: Any = paligemma.config.vision_config
        self.pad_id = int(text.pad_token_id)
        self.vocab_size = int(text.vocab_size)
        self.state_base = text.vocab_size - cfg.state_bins  # first state token id
        self.image_size = int(vision.image_size)

    def embed(self, images: Tensor, prompt_ids: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """-> tokens [B, P, D] (the Gemma input embeddings), valid [B, P] bool."""
        cfg = self.cfg
        self._check(images, prompt_ids, state)
        b = images.shape[0]
        lm = self.paligemma.language_model
        features = self.paligemma.get_image_features(images.flatten(0, 1)).pooler_output
        image_tokens = features.unflatten(0, (b, cfg.num_cameras)).flatten(1, 2)  # [B, C*N, D]
        prompt = pad_prompt(prompt_ids, cfg.max_prompt_len, self.pad_id)
        state_ids = self.state_base + discretise_state(state, cfg.state_bins)  # [B, state_dim]
        text_tokens = lm.embed_tokens(torch.cat([prompt, state_ids], dim=1))  # [B, Lmax + D_s, D]
        tokens = torch.cat([image_tokens.to(text_tokens.dtype), text_tokens], dim=1)
        valid = torch.cat(
            [
                torch.ones(image_tokens.shape[:2], dtype=torch.bool, device=tokens.device),
                prompt != self.pad_id,
                torch.ones(state_ids.shape, dtype=torch.bool, device=tokens.device),
            ],
            dim=1,
        )
        return tokens, valid

    def forward(
        self, images: Tensor, prompt_ids: Tensor, state: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        tokens, valid = self.embed(images, prompt_ids, state)  # [B, P, D], [B, P]
        allowed = block_causal_mask(valid, torch.zeros_like(valid[0], dtype=torch.long))
        bias = torch.zeros(allowed.shape, dtype=tokens.dtype, device=tokens.device)
        bias = bias.masked_fill(~allowed, torch.finfo(tokens.dtype).min)[:, None]  # [B,1,P,P]
        out = self.paligemma.language_model(
            inputs_embeds=tokens, attention_mask=bias, position_ids=positions(valid), use_cache=True
        )
        layers = out.cache.layers
        prefix_k = torch.stack([layer.keys for layer in layers])  # [layers, B, kv, P, hd]
        prefix_v = torch.stack([layer.values for layer in layers])
        return prefix_k, prefix_v, valid

    def _check(self, images: Tensor, prompt_ids: Tensor, state: Tensor) -> None:
        cfg, s = self.cfg, self.image_size
        if images.dim() != 5 or tuple(images.shape[1:]) != (cfg.num_cameras, 3, s, s):
            raise ValueError(
                f"images must be [B, {cfg.num_cameras}, 3, {s}, {s}] (cameras, RGB in [-1, 1]), "
                f"got {list(images.shape)}"
            )
        b = images.shape[0]
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != b:
            raise ValueError(f"prompt_ids must be [{b}, L] token ids, got {list(prompt_ids.shape)}")
        if prompt_ids.numel() and (prompt_ids.min() < 0 or prompt_ids.max() >= self.state_base):
            raise ValueError(
                f"prompt_ids must lie in [0, {self.state_base}) (the last {cfg.state_bins} ids "
                "are the state tokens)"
            )
        if tuple(state.shape) != (b, cfg.state_dim):
            raise ValueError(f"state must be [{b}, {cfg.state_dim}], got {list(state.shape)}")
        if not torch.isfinite(state).all():
            raise ValueError("state must be finite (normalised to [-1, 1])")
