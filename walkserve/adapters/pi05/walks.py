"""The policy as walks: the prefix prefilled once per observation, its keys and values kept as
request state, then ``num_steps`` (10) Euler steps of the action expert reading them.

    act(images, prompt_ids, state)   -> prefix_k, prefix_v, prefix_mask, flow_t = 1 (state)
      (the prompt padded to max_prompt_len first, so that every request's prefix has one
       shape: prefixes batch whatever the prompts' lengths, and so do expert steps; flow_t
       is made here, fused into the prefix encoder's dispatch, not as a glue node of its own)
      next: denoise(prefix_k, prefix_v, prefix_mask, flow_t, noise) -> actions [B, H, A]

A request to ``act`` gives all four inputs and gets ``actions``. Flow matching as pi0 defines
it: ``x_t = t * noise + (1 - t) * actions``, the expert predicts ``v = noise - actions``, and
sampling integrates from ``t = 1`` (the noise) to ``t = 0`` with ``dt = -1 / num_steps``::

    x = noise; t = 1
    repeat num_steps:  x, t = x + dt * expert(x, t, prefix), t + dt

``t`` is a per-request [B] tensor carried by the loop, so requests at different steps still
share one batched expert call.

No walk reuses a prefix for a new state: pi0.5 writes the discretised state into the prefix,
whose attention is bidirectional, so every prefix key and value (images and prompt included)
depends on the state from the first layer's attention on; a new state is a new prefix.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PaliGemmaModel

from walkserve.adapters.pi05.config import Pi05Config
from walkserve.adapters.pi05.expert import ActionExpert
from walkserve.adapters.pi05.prefix import PrefixEncoder, pad_prompt
from walkserve.capture.api import Input, loop, walk


class Pi05Policy(nn.Module):
    """PaliGemma prefix encoder + action expert; the walks above."""

    def __init__(self, paligemma: PaliGemmaModel, cfg: Pi05Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.dt = -1.0 / cfg.num_steps
        self.prefix = PrefixEncoder(paligemma, cfg)
        self.expert = ActionExpert(cfg, paligemma.config)

    @walk(
        next="denoise",
        state=("prefix_k", "prefix_v", "prefix_mask", "flow_t"),
        # token ids of any length (pad_prompt refuses one over max_prompt_len): capture cannot
        # see the vocabulary itself, the prompt is padded before the embedding reads it
        inputs={"prompt_ids": Input(vocab=lambda m: m.prefix.vocab_size)},
    )
    def act(self, images: Tensor, prompt_ids: Tensor, state: Tensor) -> dict[str, Tensor]:
        # images [B, C, 3, S, S]; prompt_ids [B, L]; state [B, state_dim]
        prompt = pad_prompt(prompt_ids, self.cfg.max_prompt_len, self.prefix.pad_id)  # [B, Lmax]
        prefix_k, prefix_v, prefix_mask = self.prefix(images, prompt, state)
        flow_t = torch.ones_like(prefix_k[0, :, 0, 0, 0])  # [B] = 1: the flow starts at the noise
        return {
            "prefix_k": prefix_k,
            "prefix_v": prefix_v,
            "prefix_mask": prefix_mask,
            "flow_t": flow_t,
        }

    @walk
    def denoise(
        self,
        prefix_k: Tensor,
        prefix_v: Tensor,
        prefix_mask: Tensor,
        flow_t: Tensor,
        noise: Tensor,
    ) -> dict[str, Tensor]:
        # prefix_k, prefix_v [layers, B, kv, P, hd]; prefix_mask [B, P]; flow_t [B]; noise [B, H, A]
        x, t = noise, flow_t
        for _ in range(self.cfg.num_steps):
            x, t = self.euler_step(x, t, prefix_k, prefix_v, prefix_mask)
        return {"actions": x}

    @loop
    def euler_step(
        self, x: Tensor, t: Tensor, prefix_k: Tensor, prefix_v: Tensor, prefix_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        velocity = self.expert(x, t, prefix_k, prefix_v, prefix_mask)  # [B, H, A]
        return x + self.dt * velocity, t + self.dt

    def sample_actions(
        self, images: Tensor, prompt_ids: Tensor, state: Tensor, noise: Tensor
    ) -> Tensor:
        """Both walks called eagerly: the action chunk [B, H, A] for one observation."""
        return self.denoise(**self.act(images, prompt_ids, state), noise=noise)["actions"]
