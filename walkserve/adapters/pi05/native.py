"""The two native baselines, plain PyTorch with no walkserve in the way, one observation batch
at a time as a robot's policy loop runs them:

    sample_actions_recompute   every Euler step runs the whole model over [prefix; actions]:
                               one attention per layer over the full sequence under the
                               block-causal mask, backbone weights for prefix tokens, expert
                               weights for action tokens (pi0's mixture of transformers; what
                               a stack without a KV cache does)
    sample_actions_cached      the prefix once (PaliGemma's cache), then the expert per step

``joint_forward`` is the full pass; the unit tests hold the cached expert against it (the
expert's attention to cached prefix keys equals full attention with the block-causal mask).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, apply_rotary_pos_emb

from walkserve.adapters.pi05.attention import attend, block_causal_mask, positions, sequence_blocks
from walkserve.adapters.pi05.walks import Pi05Policy


def _backbone_project(
    layer: GemmaDecoderLayer, x: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The first half of a backbone layer: x [B, P, D] -> q, k, v [B, heads, P, hd]."""
    b, p, _ = x.shape
    attn = layer.self_attn
    normed = layer.input_layernorm(x)
    q = attn.q_proj(normed).view(b, p, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(normed).view(b, p, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(normed).view(b, p, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _backbone_finish(layer: GemmaDecoderLayer, x: Tensor, attn: Tensor) -> Tensor:
    """The second half: residual of the attention output [B, heads, P, hd], then the MLP."""
    b, p, _ = x.shape
    x = x + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, p, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def joint_forward(
    policy: Pi05Policy, images: Tensor, prompt_ids: Tensor, state: Tensor, x_t: Tensor, t: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The full pass over [prefix; actions] -> (velocity [B, H, A], and the prefix's keys
    and values [layers, B, kv, P, hd] as this pass computed them)."""
    lm: Any = policy.prefix.paligemma.language_model
    expert = policy.expert
    prefix, valid = policy.prefix.embed(images, prompt_ids, state)  # [B, P, D], [B, P]
    actions, cond = expert.embed(x_t, t)  # [B, H, W], [B, W]
    p, h = prefix.shape[1], actions.shape[1]
    all_valid = torch.cat([valid, valid.new_ones(valid.shape[0], h)], dim=1)  # [B, P + H]
    mask = block_causal_mask(all_valid, sequence_blocks(p, h, valid.device))
    pos = positions(all_valid)
    cos_p, sin_p = lm.rotary_emb(prefix, pos[:, :p])
    cos_a, sin_a = expert.rotary(actions, pos[:, p:])
    keys, values = [], []
    for b_layer, e_layer in zip(lm.layers, expert.layers, strict=True):
        qp, kp, vp = _backbone_project(b_layer, prefix, cos_p, sin_p)
        qa, ka, va, gate = e_layer.project(actions, cond, cos_a, sin_a)
        out = attend(
            torch.cat([qp, qa], dim=2), torch.cat([kp, ka], dim=2), torch.cat([vp, va], dim=2), mask
        )  # [B, heads, P + H, hd]
        prefix = _backbone_finish(b_layer, prefix, out[:, :, :p])
        actions = e_layer.finish(actions, out[:, :, p:], gate, cond)
        keys.append(kp)
        values.append(vp)
    return expert.out(actions, cond), torch.stack(keys), torch.stack(values)


@torch.no_grad()
def sample_actions_recompute(
    policy: Pi05Policy, images: Tensor, prompt_ids: Tensor, state: Tensor, noise: Tensor
) -> Tensor:
    """Euler integration from ``noise`` with the whole model recomputed at every step."""
    x, t = noise, noise.new_ones(noise.shape[0])
    for _ in range(policy.cfg.num_steps):
        velocity, _, _ = joint_forward(policy, images, prompt_ids, state, x, t)
        x, t = x + policy.dt * velocity, t + policy.dt
    return x


@torch.no_grad()
def sample_actions_cached(
    policy: Pi05Policy, images: Tensor, prompt_ids: Tensor, state: Tensor, noise: Tensor
) -> Tensor:
    """Euler integration from ``noise`` with the prefix's keys and values computed once."""
    prefix_k, prefix_v, prefix_mask = policy.prefix(images, prompt_ids, state)
    x, t = noise, noise.new_ones(noise.shape[0])
    for _ in range(policy.cfg.num_steps):
        velocity = policy.expert(x, t, prefix_k, prefix_v, prefix_mask)
        x, t = x + policy.dt * velocity, t + policy.dt
    return x
