"""example-cfg-image: a flow-matching image generator with text and image guidance.

Two walks share one Euler loop body:

    generate(prompt_ids, noise)        -> image     text-to-image
    edit(prompt_ids, image, noise)     -> image     instruction-guided edit of ``image``

Flow matching: ``z_t = (1 - t) * x + t * noise`` and the denoiser predicts the velocity
``dz/dt``. The schedule is a grid of ``NUM_GRID_POINTS = 20`` noise levels ``sigmas`` from 1
(pure noise) down to 0 (image); sampling makes ``NUM_EULER_UPDATES = 19`` Euler updates, one
between each pair of consecutive grid points:

    sigmas:  s0=1.0   s1      s2     ...   s18     s19=0.0        (20 grid points)
    updates:     \\_0_/  \\_1_/   ...   \\_18_/                     (19 Euler updates)
    update k: z <- z + (s{k+1} - s{k}) * v(z, s{k})

Each update calls the denoiser three times, as independent branches of the graph:

    v_txt = D(z, t, text_ctx,      img_ctx)        text (and image) conditioned
    v_img = D(z, t, null_text_ctx, img_ctx)        image conditioned
    v_unc = D(z, t, null_text_ctx, null_img_ctx)   unconditioned
    v = v_unc + IMAGE_GUIDANCE * (v_img - v_unc) + TEXT_GUIDANCE * (v_txt - v_img)

The null text context is the text encoder's output for a prompt of pad tokens (the "empty
prompt"); the null image context is a learned "no image" parameter. ``generate`` conditions on
no image, so there ``img_ctx`` is the null image context and ``v_img == v_unc`` (plain
classifier-free guidance); ``edit`` encodes the input image with the image encoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.examples.blocks import (
    StackConfig,
    TransformerStack,
    init_weights,
    seeded,
    sinusoidal,
)
from walkserve.capture.api import component, loop, walk

NUM_GRID_POINTS = 20  # noise levels in the schedule, 1.0 .. 0.0
NUM_EULER_UPDATES = NUM_GRID_POINTS - 1  # 19: one update between consecutive grid points
VOCAB = 64
PAD_ID = 0
IMAGE_SIZE = 16
IMAGE_PATCH = 4
NUM_IMAGE_TOKENS = (IMAGE_SIZE // IMAGE_PATCH) ** 2  # 16
LATENT_CHANNELS = 4
LATENT_SIZE = 8  # the decoder upsamples 8x8 latents to 16x16 images
LATENT_PATCH = 2
DIM = 32
ENCODER_CONFIG = StackConfig(dim=DIM, layers=1, heads=4)
DENOISER_CONFIG = StackConfig(dim=DIM, layers=1, heads=4)
TEXT_GUIDANCE = 4.0
IMAGE_GUIDANCE = 1.5
INIT_STD = 0.15
PROMPT_LEN = 8


@component(engine="stateless")
class TextEncoder(nn.Module):
    """token ids [B, T] -> text context [B, T, D] (bidirectional)."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.stack = TransformerStack(cfg)

    def forward(self, prompt_ids: Tensor) -> Tensor:
        return self.stack.encode(self.embed(prompt_ids))


@component(engine="stateless")
class ImageEncoder(nn.Module):
    """image [B, 3, 16, 16] -> image context [B, 16, D] (one token per 4x4 patch)."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, cfg.dim, kernel_size=IMAGE_PATCH, stride=IMAGE_PATCH)
        self.stack = TransformerStack(cfg)

    def forward(self, image: Tensor) -> Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)  # [B, 16, D]
        return self.stack.encode(x)


@component(engine="stateless")
class Denoiser(nn.Module):
    """latent z [B, C, 8, 8], time t [B] or [], text context [B, T, D], image context
    [B, M, D] -> velocity [B, C, 8, 8]. Joint attention over latent patches and both contexts;
    the time embedding is added to every latent patch token."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.dim = cfg.dim
        self.patch = nn.Conv2d(
            LATENT_CHANNELS, cfg.dim, kernel_size=LATENT_PATCH, stride=LATENT_PATCH
        )
        self.time_mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim)
        )
        self.stack = TransformerStack(cfg)
        self.out = nn.Linear(cfg.dim, LATENT_CHANNELS * LATENT_PATCH * LATENT_PATCH)

    def forward(self, z: Tensor, t: Tensor, text_ctx: Tensor, img_ctx: Tensor) -> Tensor:
        b, c, height, width = z.shape
        gh, gw, p = height // LATENT_PATCH, width // LATENT_PATCH, LATENT_PATCH
        t = t.reshape(-1).expand(b)  # [B]
        temb = self.time_mlp(sinusoidal(t * 1000.0, self.dim))  # [B, D]
        x = self.patch(z).flatten(2).transpose(1, 2) + temb[:, None]  # [B, gh*gw, D]
        h = self.stack.encode(torch.cat([x, text_ctx, img_ctx], dim=1))[:, : gh * gw]
        patches = self.out(h).view(b, gh, gw, c, p, p)  # [B, gh, gw, C, p, p]
        return patches.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


@component(engine="stateless")
class Decoder(nn.Module):
    """latent [B, C, 8, 8] -> image [B, 3, 16, 16] in [-1, 1]."""

    def __init__(self, hidden: int = DIM) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(LATENT_CHANNELS, hidden, kernel_size=3, padding=1),
            nn.GELU(),
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(hidden, 3, kernel_size=3, padding=1),
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


class CFGImageModel(nn.Module):
    """Text-to-image and image editing by guided flow-matching sampling."""

    sigmas: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = TextEncoder(ENCODER_CONFIG)
        self.image_encoder = ImageEncoder(ENCODER_CONFIG)
        self.denoiser = Denoiser(DENOISER_CONFIG)
        self.decoder = Decoder()
        self.no_image = nn.Parameter(torch.zeros(1, NUM_IMAGE_TOKENS, DIM))  # [1, M, D]
        self.register_buffer("sigmas", torch.linspace(1.0, 0.0, NUM_GRID_POINTS))  # [20]
        self.text_guidance = TEXT_GUIDANCE
        self.image_guidance = IMAGE_GUIDANCE

    @walk
    def generate(self, prompt_ids: Tensor, noise: Tensor) -> dict[str, Tensor]:
        # prompt_ids: [B, T] int64; noise: [B, C, 8, 8]
        text_ctx = self.text_encoder(prompt_ids)  # [B, T, D]
        null_text_ctx = self.text_encoder(torch.full_like(prompt_ids, PAD_ID))  # [B, T, D]
        no_image = self.no_image.expand(noise.shape[0], -1, -1)  # [B, M, D]
        z = noise
        for k in range(NUM_EULER_UPDATES):
            z = self.euler_step(
                z, self.sigmas[k], self.sigmas[k + 1], text_ctx, no_image, null_text_ctx, no_image
            )
        return {"image": self.decoder(z)}  # [B, 3, 16, 16]

    @walk
    def edit(self, prompt_ids: Tensor, image: Tensor, noise: Tensor) -> dict[str, Tensor]:
        # prompt_ids: [B, T] int64; image: [B, 3, 16, 16]; noise: [B, C, 8, 8]
        text_ctx = self.text_encoder(prompt_ids)  # [B, T, D]
        null_text_ctx = self.text_encoder(torch.full_like(prompt_ids, PAD_ID))  # [B, T, D]
        img_ctx = self.image_encoder(image)  # [B, M, D]
        null_img_ctx = self.no_image.expand(image.shape[0], -1, -1)  # [B, M, D]
        z = noise
        for k in range(NUM_EULER_UPDATES):
            z = self.euler_step(
                z,
                self.sigmas[k],
                self.sigmas[k + 1],
                text_ctx,
                img_ctx,
                null_text_ctx,
                null_img_ctx,
            )
        return {"image": self.decoder(z)}  # [B, 3, 16, 16]

    @loop
    def euler_step(
        self,
        z: Tensor,
        t: Tensor,
        t_next: Tensor,
        text_ctx: Tensor,
        img_ctx: Tensor,
        null_text_ctx: Tensor,
        null_img_ctx: Tensor,
    ) -> Tensor:
        # z: [B, C, 8, 8]; t, t_next: [] (grid points k and k + 1)
        v_txt = self.denoiser(z, t, text_ctx, img_ctx)
        v_img = self.denoiser(z, t, null_text_ctx, img_ctx)
        v_unc = self.denoiser(z, t, null_text_ctx, null_img_ctx)
        v = v_unc + self.image_guidance * (v_img - v_unc) + self.text_guidance * (v_txt - v_img)
        return z + (t_next - t) * v


def build(seed: int = 0) -> tuple[CFGImageModel, dict[str, Any]]:
    """The model with seeded random weights, and the inputs of both walks (``generate`` takes
    ``prompt_ids`` and ``noise``; ``edit`` also ``image``)."""
    with seeded(seed):
        model = CFGImageModel()
        init_weights(model, INIT_STD)
        nn.init.normal_(model.no_image, std=1.0)
        prompt_ids = torch.randint(PAD_ID + 1, VOCAB, (1, PROMPT_LEN))  # [1, T]
        image = torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1  # [1, 3, 16, 16]
        noise = torch.randn(1, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)  # [1, C, 8, 8]
    model.eval().requires_grad_(False)
    return model, {"prompt_ids": prompt_ids, "image": image, "noise": noise}
