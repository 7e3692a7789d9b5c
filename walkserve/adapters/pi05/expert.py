"""The action expert: a Gemma-shaped transformer with its own weights over the action chunk,
conditioned on the flow time by adaptive RMSNorm (pi0.5), whose layer ``l`` attends to the
backbone's layer-``l`` keys and values of the prefix as well as its own.

    x_t [B, H, A] noisy actions, t [B] flow time in [0, 1]
    prefix_k, prefix_v [layers, B, kv_heads, P, hd], prefix_mask [B, P] bool
    -> v_t [B, H, A]: the velocity of the flow at (x_t, t)

    tokens = action_in(x_t)                                   [B, H, W]
    cond   = swish(time_out(swish(time_in(sincos(t)))))        [B, W]
    layer:  n, g = adarms(x, cond);  x += g * o(attn(q(n), [K_prefix; k(n)], [V_prefix; v(n)]))
            n, g = adarms(x, cond);  x += g * gemma_mlp(n)
    v_t    = action_out(adarms(x, cond)[0])

``adarms(x, c)`` normalises ``x`` by its RMS, then scales by ``1 + s``, shifts by ``b`` and
gates the residual by ``g``, where ``(s, b, g)`` is a linear function of ``c``: pi0.5's
adaptive RMSNorm, replacing pi0's timestep token mixing. Unlike pi0, the action tokens carry
no time feature; only the norms see ``t``. The MLP and the rotary embedding are transformers'
own Gemma modules (``GemmaMLP``, ``GemmaRotaryEmbedding``, ``apply_rotary_pos_emb``), so the
expert's queries are rotated exactly as the backbone's keys are.

Each layer is split in two halves, ``project`` (norm, q/k/v, RoPE) and ``finish`` (output
projection, gated residual, MLP), so that the recomputing baseline (``native``) can run one
attention over ``[prefix; actions]`` per layer with the same weights.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GemmaConfig, PaliGemmaConfig
from transformers.models.gemma.modeling_gemma import (
    GemmaMLP,
    GemmaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from walkserve.adapters.pi05.attention import action_query_mask, attend
from walkserve.adapters.pi05.config import (
    TIME_MAX_PERIOD,
    TIME_MIN_PERIOD,
    Pi05Config,
    expert_gemma_config,
)
from walkserve.capture.api import component


def time_features(t: Tensor, width: int) -> Tensor:
    """t [B] -> [B, width]: sines then cosines of ``2 pi t / period`` for ``width / 2``
    periods spaced geometrically from ``TIME_MIN_PERIOD`` to ``TIME_MAX_PERIOD``."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=t.device)
    period = TIME_MIN_PERIOD * (TIME_MAX_PERIOD / TIME_MIN_PERIOD) ** fraction
    angle = t.float()[:, None] * (2 * math.pi / period)[None]  # [B, W/2]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class AdaRMSNorm(nn.Module):
    """x [B, S, D], cond [B, C] -> (normed [B, S, D], gate [B, 1, D]); see the module
    docstring. Normalised in float32, as Gemma's RMSNorm does."""

    def __init__(self, dim: int, cond_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.modulation = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        scale, shift, gate = self.modulation(cond)[:, None].chunk(3, dim=-1)  # each [B, 1, D]
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + scale.float()) + shift.float()).type_as(x), gate


class ExpertLayer(nn.Module):
    """One Gemma decoder layer with adaptive RMSNorms and gated residuals (module docstring)."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        width, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.attn_norm = AdaRMSNorm(width, width, config.rms_norm_eps)
        self.q_proj = nn.Linear(width, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, width, bias=False)
        self.mlp_norm = AdaRMSNorm(width, width, config.rms_norm_eps)
        self.mlp = GemmaMLP(config)

    def project(
        self, x: Tensor, cond: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, S, W] -> q [B, Hq, S, hd], k and v [B, Hkv, S, hd] (q, k rotated), the
        attention residual's gate [B, 1, W]."""
        b, s, _ = x.shape
        normed, gate = self.attn_norm(x, cond)
        q = self.q_proj(normed).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(normed).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(normed).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, gate

    def finish(self, x: Tensor, attn: Tensor, gate: Tensor, cond: Tensor) -> Tensor:
        """x [B, S, W], attn [B, Hq, S, hd] (this layer's attention output) -> x [B, S, W]."""
        b, s, _ = x.shape
        x = x + gate * self.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        normed, gate = self.mlp_norm(x, cond)
        return x + gate * self.mlp(normed)


@component(engine="stateless")
class ActionExpert(nn.Module):
    """x_t, t, prefix_k, prefix_v, prefix_mask -> v_t (see the module docstring)."""

    def __init__(self, cfg: Pi05Config, backbone: PaliGemmaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        config = expert_gemma_config(cfg, backbone)
        width = config.hidden_size
        self.action_in = nn.Linear(cfg.action_dim, width)
        self.time_in = nn.Linear(width, width)
        self.time_out = nn.Linear(width, width)
        self.layers = cast(
            "list[ExpertLayer]",
            nn.ModuleList(ExpertLayer(config) for _ in range(config.num_hidden_layers)),
        )
        self.norm = AdaRMSNorm(width, width, config.rms_norm_eps)
        self.action_out = nn.Linear(width, cfg.action_dim)
        self.rotary = GemmaRotaryEmbedding(config)

    def embed(self, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """-> action tokens [B, H, W], the time condition [B, W]."""
        width = self.time_in.in_features
        cond = F.silu(self.time_in(time_features(t, width).to(x_t.dtype)))
        return self.action_in(x_t), F.silu(self.time_out(cond))

    def out(self, x: Tensor, cond: Tensor) -> Tensor:
        """The last layer's action tokens [B, H, W] -> velocity [B, H, A]."""
        return self.action_out(self.norm(x, cond)[0])

    def forward(
        self, x_t: Tensor, t: Tensor, prefix_k: Tensor, prefix_v: Tensor, prefix_mask: Tensor
    ) -> Tensor:
        cfg = self.cfg
        if tuple(x_t.shape[1:]) != (cfg.action_horizon, cfg.action_dim):
            raise ValueError(
                f"noise must be [B, {cfg.action_horizon}, {cfg.action_dim}] (the action chunk), "
                f"got {list(x_t.shape)}"
            )
        h = x_t.shape[1]
        x, cond = self.embed(x_t, t)  # [B, H, W], [B, W]
        n_valid = prefix_mask.sum(dim=-1, keepdim=True)  # [B, 1]
        pos = n_valid + torch.arange(h, device=x.device)[None]  # [B, H]
        cos, sin = self.rotary(x, pos)
        mask = action_query_mask(prefix_mask, h)  # [B, H, P + H]
        for i, layer in enumerate(self.layers):
            q, k, v, gate = layer.project(x, cond, cos, sin)
            keys = torch.cat([prefix_k[i], k], dim=2)  # [B, Hkv, P + H, hd]
            values = torch.cat([prefix_v[i], v], dim=2)
            x = layer.finish(x, attend(q, keys, values, mask), gate, cond)
        return self.out(x, cond)
