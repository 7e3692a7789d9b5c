"""A guided flow sampler written as a newcomer writes one: plain PyTorch, the schedule built
from an int argument, seeded noise from a ``torch.Generator`` made inside the method. The
decorators are the only additions; capture takes ``range(points - 1)``, ``torch.linspace(...,
points)`` and the generator as written (the Python API is the eager one).

    sample(prompt_ids [B, T], ref [B, C, H, W], points, seed, ...) -> image [B, 3, 2H, 2W]

Three guidance branches per Euler step (text and reference conditioned, reference only,
unconditioned), combined as ``v_unc + g_ref (v_ref - v_unc) + g_txt (v_txt - v_ref)``, over the
``points``-point grid ``linspace(1, 0, points)`` (``points - 1`` updates). Not a registered
built-in: serve it as ``walkserve.adapters.examples.flow:build``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from walkserve.capture import component, loop, walk

VOCAB = 32
DIM = 16
CHANNELS = 2
SIZE = 4
PROMPT_LEN = 5
POINTS = 8


@component
class TextEncoder(nn.Module):
    """ids [B, T] -> context [B, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.tanh(self.mix(self.embed(ids).mean(dim=1)))


@component
class RefEncoder(nn.Module):
    """reference latent [B, C, H, W] -> context [B, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(CHANNELS * SIZE * SIZE, DIM)

    def forward(self, ref: Tensor) -> Tensor:
        return torch.tanh(self.proj(ref.flatten(1)))


@component
class Velocity(nn.Module):
    """z [B, C, H, W], t [] (a grid point), text [B, D], ref [B, D] -> dz/dt [B, C, H, W]."""

    def __init__(self) -> None:
        super().__init__()
        width = CHANNELS * SIZE * SIZE
        self.inp = nn.Linear(width + 2 * DIM + 1, 32)
        self.out = nn.Linear(32, width)

    def forward(self, z: Tensor, t: Tensor, text: Tensor, ref: Tensor) -> Tensor:
        b = z.shape[0]
        x = torch.cat([z.flatten(1), text, ref, t.reshape(1, 1).expand(b, 1)], dim=1)
        return self.out(torch.nn.functional.gelu(self.inp(x))).view_as(z)


@component
class Decoder(nn.Module):
    """latent [B, C, H, W] -> image [B, 3, 2H, 2W] in [-1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(CHANNELS, 3, kernel_size=3, padding=1)
        self.up = nn.Upsample(scale_factor=2)

    def forward(self, z: Tensor) -> Tensor:
        return torch.tanh(self.up(self.conv(z)))


class FlowSampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text = TextEncoder()
        self.ref = RefEncoder()
        self.velocity = Velocity()
        self.decoder = Decoder()
        self.no_ref = nn.Parameter(torch.zeros(1, DIM))

    @walk
    def sample(
        self,
        prompt_ids: Tensor,
        ref: Tensor,
        points: int,
        seed: int,
        text_guidance: float = 3.0,
        ref_guidance: float = 1.5,
    ) -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(prompt_ids.shape[0], CHANNELS, SIZE, SIZE, generator=g)
        sigmas = torch.linspace(1.0, 0.0, points)  # [points]
        text = self.text(prompt_ids)
        null_text = self.text(torch.zeros_like(prompt_ids))
        ref_ctx = self.ref(ref)
        null_ref = self.no_ref.expand(prompt_ids.shape[0], -1)
        for k in range(points - 1):
            z = self.step(
                z, sigmas[k], sigmas[k + 1], text, null_text, ref_ctx, null_ref,
                text_guidance, ref_guidance,
            )  # fmt: skip
        return {"image": self.decoder(z)}

    @loop
    def step(
        self,
        z: Tensor,
        t: Tensor,
        t_next: Tensor,
        text: Tensor,
        null_text: Tensor,
        ref_ctx: Tensor,
        null_ref: Tensor,
        text_guidance: float,
        ref_guidance: float,
    ) -> Tensor:
        v_txt = self.velocity(z, t, text, ref_ctx)
        v_ref = self.velocity(z, t, null_text, ref_ctx)
        v_unc = self.velocity(z, t, null_text, null_ref)
        v = v_unc + ref_guidance * (v_ref - v_unc) + text_guidance * (v_txt - v_ref)
        return z + (t_next - t) * v


def build(seed: int = 0) -> tuple[FlowSampler, dict[str, Any]]:
    """The sampler with seeded random weights, and a sample request."""
    gen = torch.Generator().manual_seed(seed)
    model = FlowSampler()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval().requires_grad_(False)
    sample = {
        "prompt_ids": torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen),
        "ref": torch.randn(1, CHANNELS, SIZE, SIZE, generator=gen),
        "points": POINTS,
        "seed": 11,
    }
    return model, sample
