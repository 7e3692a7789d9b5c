"""Small building blocks shared by the built-in example models.

Nothing here is a component: each example model wraps these blocks in its own ``@component``
classes, so every graph node is a class that the model file names. Nothing here knows about
capture or the runtime either; these are plain PyTorch modules.

KV caches are explicit tensors passed in and returned, never hidden module state:

    past_k, past_v: [layers, B, heads, T, head_dim]      T = 0 for an empty cache (never None)
    new_k:          [layers, B, heads, T + S, head_dim]  past_k with the S new tokens' keys
                                                         concatenated along dim 3

Attention masks, by ``block_size``: ``1`` is token-causal; ``n`` is block-causal (a token sees
every token of its own block of ``n`` and of all earlier blocks; the cache holds whole blocks);
``None`` is full bidirectional attention, which the encoders use with an empty cache.

    block-causal, n=2, T=2 cached, S=4 new        keys:  0 1 | 2 3 | 4 5
        queries 2, 3 (block 1)                           x x   x x   . .
        queries 4, 5 (block 2)                           x x   x x   x x

Positions are absolute: token ``i`` of the new ones sits at position ``T + i`` and gets the
sinusoidal encoding of that position, so a cached decode matches a full recompute.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class StackConfig:
    """Width and depth of a transformer stack; ``dim`` must split evenly into ``heads``."""

    dim: int
    layers: int
    heads: int
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"StackConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(
                f"StackConfig.dim ({self.dim}) must be heads ({self.heads}) times an even head_dim"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the global RNG seeded to ``seed``, restoring the caller's RNG after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def init_weights(module: nn.Module, std: float, embed_std: float = 1.0) -> None:
    """Normal(0, std) weights for every linear and convolution, zero biases; Normal(0,
    embed_std) embeddings. The default ``embed_std`` puts token embeddings on the scale of the
    sinusoidal position features (unit amplitude), so that with random weights the token, not
    its position, decides what comes next."""
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=embed_std)
        elif isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def sinusoidal(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of (possibly fractional) positions: [...] -> [..., dim]."""
    half = dim // 2
    steps = torch.arange(half, dtype=torch.float32, device=positions.device)
    freqs = torch.exp(-math.log(10000.0) * steps / half)  # [half]
    angles = positions.to(torch.float32)[..., None] * freqs  # [..., half]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # [..., dim]


def empty_kv(cfg: StackConfig, like: Tensor) -> tuple[Tensor, Tensor]:
    """An empty cache for a batch of ``like.shape[0]``: two [layers, B, heads, 0, head_dim]
    float32 tensors on ``like``'s device."""
    shape = (cfg.layers, like.shape[0], cfg.heads, 0, cfg.head_dim)
    return like.new_zeros(shape, dtype=torch.float32), like.new_zeros(shape, dtype=torch.float32)


def attention_mask(
    past: int, new: int, block_size: int | None, device: torch.device
) -> Tensor | None:
    """[new, past + new] bool, True where query ``past + i`` may attend to key ``j``."""
    if block_size is None:
        return None
    q_block = torch.arange(past, past + new, device=device) // block_size  # [S]
    k_block = torch.arange(past + new, device=device) // block_size  # [T + S]
    return k_block[None, :] <= q_block[:, None]


class Block(nn.Module):
    """Pre-norm transformer block: attention over cached + new keys, then an MLP."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, S, D]; past_k, past_v: [B, H, T, hd]; mask: [S, T + S] or None
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, S, hd]
        k = torch.cat([past_k, k], dim=2)  # [B, H, T + S, hd]
        v = torch.cat([past_v, v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, hd]
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        x = x + self.mlp(self.norm2(x))
        return x, k, v


class TransformerStack(nn.Module):
    """``layers`` blocks with explicit KV; see the module docstring for layout and masks."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, block_size: int | None = 1
    ) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, S, D]; past_k, past_v: [layers, B, H, T, hd]
        past, new = past_k.shape[3], x.shape[1]
        positions = torch.arange(past, past + new, device=x.device)  # [S]
        x = x + sinusoidal(positions, self.cfg.dim)
        mask = attention_mask(past, new, block_size, x.device)
        keys, values = [], []
        for layer, block in enumerate(self.blocks):
            x, k, v = block(x, past_k[layer], past_v[layer], mask)
            keys.append(k)
            values.append(v)
        # h: [B, S, D]; new_k, new_v: [layers, B, H, T + S, hd]
        return self.norm(x), torch.stack(keys), torch.stack(values)

    def encode(self, x: Tensor) -> Tensor:
        """Full attention over ``x`` [B, S, D] with no cache: [B, S, D]."""
        past_k, past_v = empty_kv(self.cfg, x)
        h, _, _ = self(x, past_k, past_v, block_size=None)
        return h


class CausalLM(nn.Module):
    """A tiny decoder-only LM over token ids with an explicit KV cache. Not a component by
    itself: the example models subclass it as their ``kv_cache`` components and choose in
    ``forward`` which of ``run``'s outputs the graph sees."""

    def __init__(self, vocab: int, cfg: StackConfig) -> None:
        super().__init__()
        self.vocab, self.cfg = vocab, cfg
        self.embed = nn.Embedding(vocab, cfg.dim)
        self.stack = TransformerStack(cfg)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)

    def run(
        self, tokens: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # tokens: [B, S] int64; past_k, past_v: [layers, B, H, T, hd]
        hidden, new_k, new_v = self.stack(self.embed(tokens), past_k, past_v)  # hidden: [B, S, D]
        return self.head(hidden), hidden, new_k, new_v  # logits: [B, S, vocab]
