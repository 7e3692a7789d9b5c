"""The V-JEPA 2-AC action-conditioned predictor, written here from the V-JEPA 2 paper's
description (transformers ships only the encoder and the masked predictor). It knows nothing
of walks: ``vjepa2_ac`` runs it inside its rollouts, as a ``kv_cache`` component.

What crosses its boundary: ``PredictorConfig`` (its shape, read from and written to
``predictor_config.json`` by ``vjepa2_ac``'s checkpoints) and ``ACPredictor``, whose forward
takes F new blocks and the K/V of T earlier tokens::

    frame_tokens   [B, F, N, De]                 encoder tokens of F frames
    actions        [B, F, A], states [B, F, S]   the action and state of each block
    past_k, past_v [layers, B, H, T, hd]         T = earlier blocks * (N + 2)
    -> next        [B, F, N, De]                 block f's prediction of frame f + 1
    -> new_k/v     [layers, B, H, T + F * (N + 2), hd]

One block per time step, ``[action | state | N frame tokens]``; a token of block t attends to
every token of blocks <= t (``block_causal_mask``). Positions are absolute (3D RoPE (t, row,
col) on frame tokens, 1D RoPE (t) on action/state tokens, ``rope_angles``) and keys are cached
rotated, so a cached key equals the key a full recompute would produce.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from walkserve.capture.api import component

__all__ = ["ACPredictor", "PredictorConfig", "block_causal_mask", "rope_angles"]

ROPE_BASE = 10000.0


@dataclass(frozen=True)
class PredictorConfig:
    """Shape of the action-conditioned predictor. ``embed_dim`` is the encoder's hidden size,
    ``grid`` its patches per side (N = grid**2 tokens per frame)."""

    embed_dim: int
    grid: int
    dim: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    action_dim: int = 7
    state_dim: int = 7

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PredictorConfig.{f.name} must be a positive int, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"PredictorConfig.dim ({self.dim}) must split into {self.heads} heads")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(
                f"PredictorConfig head_dim ({self.head_dim}) must be even and >= 6 for 3D RoPE"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def tokens_per_frame(self) -> int:
        return self.grid * self.grid

    @property
    def block_size(self) -> int:
        return self.tokens_per_frame + 2  # action, state, N frame tokens

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PredictorConfig:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown PredictorConfig keys {sorted(unknown)}")
        return cls(**data)


def rope_angles(cfg: PredictorConfig, first_block: int, blocks: int, device: Any) -> Tensor:
    """Rotation angles [S, head_dim / 2] for ``blocks`` blocks starting at absolute block
    ``first_block``. The head dimension is split into a time part and two spatial parts
    (rows, columns); action and state tokens sit at row = col = 0 (identity rotation), so
    they carry time only.

        head_dim pairs:  [ time ........ | rows ..... | cols ..... ]
        frame token (t, i, j):  t * w_time   i * w_row    j * w_col
        action/state (t):       t * w_time   0            0
    """
    pairs = cfg.head_dim // 2
    space = pairs // 3  # pairs per spatial axis
    time = pairs - 2 * space

    def freqs(n: int) -> Tensor:
        return ROPE_BASE ** (-torch.arange(n, device=device, dtype=torch.float32) / n)

    n = cfg.grid
    t = torch.arange(first_block, first_block + blocks, device=device, dtype=torch.float32)
    rows = torch.arange(n, device=device, dtype=torch.float32).repeat_interleave(n)  # [N]
    cols = torch.arange(n, device=device, dtype=torch.float32).repeat(n)  # [N]
    zero2 = torch.zeros(2, device=device)
    row_pos = torch.cat([zero2, rows])  # [N + 2] per block
    col_pos = torch.cat([zero2, cols])
    t_pos = t.repeat_interleave(cfg.block_size)  # [S]
    r_pos, c_pos = row_pos.repeat(blocks), col_pos.repeat(blocks)  # [S]
    return torch.cat(
        [
            t_pos[:, None] * freqs(time),
            r_pos[:, None] * freqs(space),
            c_pos[:, None] * freqs(space),
        ],
        dim=-1,
    )  # [S, head_dim / 2]


def rotate(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x`` [B, H, S, hd] by ``angles`` [S, hd / 2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [B, H, S, hd/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def block_causal_mask(past: int, new: int, block_size: int, device: Any) -> Tensor:
    """[new, past + new] bool: query ``past + i`` may see key ``j`` iff j's block <= i's."""
    q_block = torch.arange(past, past + new, device=device) // block_size  # [S]
    k_block = torch.arange(past + new, device=device) // block_size  # [T + S]
    return k_block[None, :] <= q_block[:, None]


class PredictorLayer(nn.Module):
    """Pre-norm transformer layer: RoPE attention over cached + new keys, then a GELU MLP.
    Keys are stored rotated (at their absolute positions), so the cache never changes."""

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(
        self, x: Tensor, cache_k: Tensor, cache_v: Tensor, angles: Tensor, mask: Tensor
    ) -> Tensor:
        # x: [B, S, D]; cache_k, cache_v: [B, H, T + S, hd] with the T cached keys filled in:
        # the S new keys and values are written into the last S positions, then attended.
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, S, hd]
        q = rotate(q, angles)
        cache_k[:, :, -s:] = rotate(k, angles)
        cache_v[:, :, -s:] = v
        y = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)  # [B, H, S, hd]
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


@component(engine="kv_cache")
class ACPredictor(nn.Module):
    """Action-conditioned predictor: frame tokens [B, F, N, De], actions [B, F, A], states
    [B, F, S], past_k/v [layers, B, H, T, hd] -> next-frame tokens [B, F, N, De] (block f's
    prediction of frame f + 1), new_k/v [layers, B, H, T + F * (N + 2), hd].

    The F new blocks continue the T cached tokens (T a multiple of N + 2): their time
    positions start at block T / (N + 2)."""

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.frame_in = nn.Linear(cfg.embed_dim, cfg.dim)
        self.action_in = nn.Linear(cfg.action_dim, cfg.dim)
        self.state_in = nn.Linear(cfg.state_dim, cfg.dim)
        self.layers = nn.ModuleList(PredictorLayer(cfg) for _ in range(cfg.layers))
        self.out_norm = nn.LayerNorm(cfg.dim)
        self.frame_out = nn.Linear(cfg.dim, cfg.embed_dim)

    def forward(
        self,
        frame_tokens: Tensor,
        actions: Tensor,
        states: Tensor,
        past_k: Tensor,
        past_v: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        b, f, n, _ = frame_tokens.shape
        if n != cfg.tokens_per_frame:
            raise ValueError(f"frames give {n} tokens each; the predictor expects {cfg.grid}**2")
        past = past_k.shape[3]
        x = torch.cat(
            [
                self.action_in(actions)[:, :, None],  # [B, F, 1, D]
                self.state_in(states)[:, :, None],  # [B, F, 1, D]
                self.frame_in(frame_tokens),  # [B, F, N, D]
            ],
            dim=2,
        ).reshape(b, f * cfg.block_size, cfg.dim)  # [B, S, D], S = F * (N + 2)
        angles = rope_angles(cfg, past // cfg.block_size, f, x.device)  # [S, hd/2]
        mask = block_causal_mask(past, x.shape[1], cfg.block_size, x.device)  # [S, T + S]
        # One copy of the past per step (not a concatenation per layer and a stack after).
        new_k = past_k.new_empty((cfg.layers, b, cfg.heads, past + x.shape[1], cfg.head_dim))
        new_v = torch.empty_like(new_k)
        new_k[:, :, :, :past] = past_k
        new_v[:, :, :, :past] = past_v
        for i, layer in enumerate(self.layers):
            x = layer(x, new_k[i], new_v[i], angles, mask)
        h = self.out_norm(x).view(b, f, cfg.block_size, cfg.dim)[:, :, 2:]  # [B, F, N, D]
        return self.frame_out(h), new_k, new_v

    def empty_cache(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """Two empty [layers, B, heads, 0, hd] caches for a batch of ``like.shape[0]``."""
        cfg = self.cfg
        shape = (cfg.layers, like.shape[0], cfg.heads, 0, cfg.head_dim)
        return like.new_zeros(shape), like.new_zeros(shape)
