"""diffusers Stable Diffusion 3 (a flow-matching DiT with true classifier-free guidance) as walks.

The upstream parts are used unmodified: the two CLIP text encoders
(``CLIPTextModelWithProjection``), the ``SD3Transformer2DModel`` (registered as a component and
called as the pipeline calls it), the ``AutoencoderKL`` decoder and the
``FlowMatchEulerDiscreteScheduler`` (its ``set_timesteps`` makes each request's schedule). What
this module adds is the loop ``StableDiffusion3Pipeline.__call__`` hides, written so that capture
sees its structure:

    generate(prompt_ids, negative_ids, latents, sigmas, timesteps, guidance_scale, num_steps)
        ctx,  pooled  = encode(prompt_ids)            CLIP-L and CLIP-G (stateless components)
        nctx, npooled = encode(negative_ids)
        for k in iterations(num_steps):               Loop; its body is
            v_c = transformer(z, t_k, ctx,  pooled)       \\ Parallel: two guidance branches
            v_u = transformer(z, t_k, nctx, npooled)      /  (one rank each in 2ranks.yaml)
            v   = v_u + g * (v_c - v_u)                   guidance combine (glue)
            z   = z + (sigma_{k+1} - sigma_k) * v         the scheduler's Euler step (glue)
        image = (vae.decode(z / scaling + shift) * 0.5 + 0.5).clamp(0, 1)   [B, 3, H, W]

Crossing the boundary: walk inputs are tensors a client (or ``request_inputs``) makes on the host:
token ids of both CLIP tokenizers side by side ``[B, 2L]``, initial latents drawn from
``torch.Generator().manual_seed(seed)`` exactly as the pipeline draws them, the scheduler's
``sigmas [B, N+1]`` and ``timesteps [B, N]`` for N steps, ``guidance_scale [B]`` and the int N.
The output is ``image [B, 3, H, W]`` in [0, 1], what the pipeline returns for
``output_type="pt"``.

The Euler step is reproduced as glue (``z + dt * v``, float32) rather than calling
``scheduler.step``: the upstream step reads and advances a Python ``step_index`` held in the
scheduler object, which a loop body traced once cannot express and which would be shared by every
request. Its deterministic path is exactly that one line; stochastic sampling and per-token
timesteps are refused. The third text encoder (T5) is not used (``text_encoder_3=None``, an SD3
mode the pipeline supports: its part of the context is zeros, as upstream). The tiny random
pipelines ``tiny`` and ``bench`` serve are built in ``diffusers_tiny``; the pipelines' own images,
the reference the walks are checked against, come from ``diffusers_upstream``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from walkserve.adapters.diffusers_tiny import BENCH, TINY, tiny_pipeline
from walkserve.capture.api import Input, component, iterations, loop, register_component, walk


@component(engine="stateless")
class ClipTextEncoder(nn.Module):
    """token ids [B, L] -> (penultimate hidden states [B, L, D], pooled projection [B, P]): the
    two values SD3 takes from an upstream ``CLIPTextModelWithProjection``."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        out = self.encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2], out[0]


@component(engine="stateless")
class VaeDecoder(nn.Module):
    """latents [B, C, h, w] (already unscaled) -> image [B, 3, H, W] in about [-1, 1]."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latents: Tensor) -> Tensor:
        return self.vae.decode(latents, return_dict=False)[0]  # type: ignore[operator,no-any-return]


@component(engine="stateless")
class VaeEncoder(nn.Module):
    """image [B, 3, H, W] in [-1, 1] -> (mean, std) [B, C, h, w] of the upstream VAE's latent
    distribution (its ``latent_dist``)."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, image: Tensor) -> tuple[Tensor, Tensor]:
        dist = self.vae.encode(image).latent_dist  # type: ignore[operator]
        return dist.mean, dist.std


@dataclass(frozen=True)
class SD3Shapes:
    """What the walks need to know about the pipeline's configuration."""

    ids_len: int  # L: tokens per CLIP tokenizer (its model_max_length)
    t5_len: int  # zero context tokens where T5's output would be (pipeline max_sequence_length)
    joint_dim: int  # the transformer's context width
    scaling_factor: float
    shift_factor: float

    def __post_init__(self) -> None:
        if self.ids_len <= 0 or self.t5_len < 0 or self.joint_dim <= 0:
            raise ValueError(f"bad SD3 shapes: {self}")


# sigmas [B, N+1] and timesteps [B, N]: any number of steps N.
SCHEDULE_INPUTS = {"sigmas": Input(dims={1: "dynamic"}), "timesteps": Input(dims={1: "dynamic"})}


class SD3Walks(nn.Module):
    """The ``generate`` walk around the parts of a ``StableDiffusion3Pipeline`` (no T5)."""

    def __init__(self, pipe: Any, t5_len: int = 256) -> None:
        super().__init__()
        from diffusers import SD3Transformer2DModel

        if getattr(pipe, "text_encoder_3", None) is not None:
            raise ValueError(
                "the T5 text encoder is not supported: load the pipeline with "
                "text_encoder_3=None, tokenizer_3=None"
            )
        cfg = pipe.scheduler.config
        if cfg.get("stochastic_sampling") or cfg.get("use_dynamic_shifting"):
            raise ValueError(
                "the scheduler must be a plain FlowMatchEulerDiscreteScheduler: set "
                "stochastic_sampling=False and use_dynamic_shifting=False"
            )
        register_component(SD3Transformer2DModel, engine="stateless")
        self.text_encoder = ClipTextEncoder(pipe.text_encoder)
        self.text_encoder_2 = ClipTextEncoder(pipe.text_encoder_2)
        self.transformer = pipe.transformer
        self.vae_decoder = VaeDecoder(pipe.vae)
        self.vae_encoder = VaeEncoder(pipe.vae)
        self.shapes = SD3Shapes(
            ids_len=int(pipe.tokenizer_max_length),
            t5_len=t5_len,
            joint_dim=int(pipe.transformer.config.joint_attention_dim),
            scaling_factor=float(pipe.vae.config.scaling_factor),
            shift_factor=float(pipe.vae.config.shift_factor),
        )
        # Host-side parts for request_inputs (not modules, never traced).
        self.host = HostParts(pipe.tokenizer, pipe.tokenizer_2, pipe.scheduler, pipe)

    def encode(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        # ids: [B, 2L] (CLIP-L ids, then CLIP-G ids)
        n = self.shapes.ids_len
        h1, p1 = self.text_encoder(ids[:, :n])  # [B, L, D1], [B, P1]
        h2, p2 = self.text_encoder_2(ids[:, n:])  # [B, L, D2], [B, P2]
        clip = torch.cat([h1, h2], dim=-1)  # [B, L, D1 + D2]
        # Zero-pad to the context width and append the (absent) T5 tokens as zeros.
        ctx = F.pad(clip, (0, self.shapes.joint_dim - clip.shape[-1], 0, self.shapes.t5_len))
        return ctx, torch.cat([p1, p2], dim=-1)  # [B, L + T5, J], [B, P1 + P2]

    @walk(inputs=SCHEDULE_INPUTS)
    def generate(
        self,
        prompt_ids: Tensor,
        negative_ids: Tensor,
        latents: Tensor,
        sigmas: Tensor,
        timesteps: Tensor,
        guidance_scale: Tensor,
        num_steps: int,
    ) -> dict[str, Tensor]:
        # prompt_ids, negative_ids: [B, 2L]; latents: [B, C, h, w]; sigmas: [B, N+1];
        # timesteps: [B, N]; guidance_scale: [B]
        ctx, pooled = self.encode(prompt_ids)
        neg_ctx, neg_pooled = self.encode(negative_ids)
        return self.sample(
            latents, sigmas, timesteps, guidance_scale, num_steps, ctx, pooled, neg_ctx, neg_pooled
        )

    @walk(inputs=SCHEDULE_INPUTS)
    def edit(
        self,
        prompt_ids: Tensor,
        negative_ids: Tensor,
        image: Tensor,
        noise: Tensor,
        sigmas: Tensor,
        timesteps: Tensor,
        guidance_scale: Tensor,
        num_steps: int,
    ) -> dict[str, Tensor]:
        # image: [B, 3, H, W] in [-1, 1]; noise: [B, 2, C, h, w] (the posterior draw, then the
        # initial noise: the two draws StableDiffusion3Img2ImgPipeline makes from its generator);
        # sigmas: [B, N+1] and timesteps [B, N] from the first step strength lets run
        ctx, pooled = self.encode(prompt_ids)
        neg_ctx, neg_pooled = self.encode(negative_ids)
        mean, std = self.vae_encoder(image)  # [B, C, h, w] each
        x0 = (mean + std * noise[:, 0] - self.shapes.shift_factor) * self.shapes.scaling_factor
        s0 = sigmas[:, 0][:, None, None, None]  # [B, 1, 1, 1]
        z = s0 * noise[:, 1] + (1.0 - s0) * x0  # the scheduler's scale_noise
        return self.sample(
            z, sigmas, timesteps, guidance_scale, num_steps, ctx, pooled, neg_ctx, neg_pooled
        )

    def sample(
        self,
        z: Tensor,
        sigmas: Tensor,
        timesteps: Tensor,
        guidance_scale: Tensor,
        num_steps: int,
        ctx: Tensor,
        pooled: Tensor,
        neg_ctx: Tensor,
        neg_pooled: Tensor,
    ) -> dict[str, Tensor]:
        """The denoising loop from latents ``z`` [B, C, h, w], then the VAE decode."""
        for k in iterations(num_steps):
            z = self.denoise_step(
                z,
                timesteps[:, k],
                sigmas[:, k],
                sigmas[:, k + 1],
                ctx,
                pooled,
                neg_ctx,
                neg_pooled,
                guidance_scale,
            )
        z = z / self.shapes.scaling_factor + self.shapes.shift_factor
        image = self.vae_decoder(z)  # [B, 3, H, W]
        return {"image": (image * 0.5 + 0.5).clamp(0, 1)}

    @loop
    def denoise_step(
        self,
        z: Tensor,
        t: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        ctx: Tensor,
        pooled: Tensor,
        neg_ctx: Tensor,
        neg_pooled: Tensor,
        guidance_scale: Tensor,
    ) -> Tensor:
        # z: [B, C, h, w]; t, sigma, sigma_next, guidance_scale: [B]
        v_cond = self.transformer(
            hidden_states=z,
            timestep=t,
            encoder_hidden_states=ctx,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        v_uncond = self.transformer(
            hidden_states=z,
            timestep=t,
            encoder_hidden_states=neg_ctx,
            pooled_projections=neg_pooled,
            return_dict=False,
        )[0]
        v = v_uncond + guidance_scale[:, None, None, None] * (v_cond - v_uncond)
        return z + (sigma_next - sigma)[:, None, None, None] * v


@dataclass(frozen=True)
class HostParts:
    """Tokenizers and scheduler, used on the host to turn a request into walk inputs."""

    tokenizer: Any
    tokenizer_2: Any
    scheduler: Any
    pipe: Any

    @property
    def latent_channels(self) -> int:
        return int(self.pipe.transformer.config.in_channels)

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor) * int(self.pipe.transformer.config.patch_size)


def prompt_ids(walks: SD3Walks, text: str) -> list[int]:
    """``text`` through both CLIP tokenizers as the pipeline calls them: 2L ids."""
    ids: list[int] = []
    for tok in (walks.host.tokenizer, walks.host.tokenizer_2):
        enc = tok(
            text, padding="max_length", max_length=walks.shapes.ids_len, truncation=True
        ).input_ids
        ids.extend(int(i) for i in enc)
    return ids


def schedule(walks: SD3Walks, steps: int) -> tuple[Tensor, Tensor]:
    """The upstream scheduler's ``sigmas [N+1]`` and ``timesteps [N]`` for ``steps`` steps
    (on a fresh scheduler of the same config, as the pipeline's ``retrieve_timesteps``)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sched = type(walks.host.scheduler).from_config(walks.host.scheduler.config)
    sched.set_timesteps(steps)
    return sched.sigmas.float(), sched.timesteps.float()


def request_inputs(
    walks: SD3Walks,
    prompt: str,
    *,
    negative_prompt: str = "",
    seed: int = 0,
    steps: int = 4,
    guidance_scale: float = 5.0,
    size: int | None = None,
) -> dict[str, Any]:
    """The walk inputs of one request, made the way ``StableDiffusion3Pipeline`` makes them for
    ``generator=torch.Generator().manual_seed(seed)`` on CPU."""
    if guidance_scale <= 1.0:
        raise ValueError(
            f"guidance_scale must be > 1 (the walk always runs both guidance branches), "
            f"got {guidance_scale}"
        )
    size = size or native_size(walks)
    multiple = walks.host.size_multiple
    if size <= 0 or size % multiple:
        raise ValueError(f"size must be a positive multiple of {multiple}, got {size}")
    sigmas, timesteps = schedule(walks, steps)
    h = size // int(walks.host.pipe.vae_scale_factor)
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn((1, walks.host.latent_channels, h, h), generator=generator)
    return {
        "prompt_ids": torch.tensor([prompt_ids(walks, prompt)]),  # [1, 2L]
        "negative_ids": torch.tensor([prompt_ids(walks, negative_prompt)]),  # [1, 2L]
        "latents": latents,  # [1, C, h, h]
        "sigmas": sigmas[None],  # [1, N+1]
        "timesteps": timesteps[None],  # [1, N]
        "guidance_scale": torch.tensor([guidance_scale]),  # [1]
        "num_steps": steps,
    }


def edit_inputs(
    walks: SD3Walks,
    prompt: str,
    image: Tensor,
    *,
    negative_prompt: str = "",
    seed: int = 0,
    steps: int = 4,
    strength: float = 0.6,
    guidance_scale: float = 5.0,
) -> dict[str, Any]:
    """The ``edit`` walk's inputs for ``image`` [1, 3, H, W] in [0, 1], made the way
    ``StableDiffusion3Img2ImgPipeline`` makes them (``strength`` skips the first steps of the
    schedule; its generator draws the VAE posterior sample, then the initial noise)."""
    if guidance_scale <= 1.0:
        raise ValueError(f"guidance_scale must be > 1, got {guidance_scale}")
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    multiple = walks.host.size_multiple
    if image.dim() != 4 or image.shape[:2] != (1, 3) or image.shape[2] % multiple:
        raise ValueError(
            f"image must be [1, 3, H, W] with H, W multiples of {multiple}, got {list(image.shape)}"
        )
    sigmas, timesteps = schedule(walks, steps)
    start = int(max(steps - min(steps * strength, steps), 0))  # < steps as strength > 0
    scale = int(walks.host.pipe.vae_scale_factor)
    latent_shape = (walks.host.latent_channels, image.shape[2] // scale, image.shape[3] // scale)
    generator = torch.Generator().manual_seed(seed)
    return {
        "prompt_ids": torch.tensor([prompt_ids(walks, prompt)]),  # [1, 2L]
        "negative_ids": torch.tensor([prompt_ids(walks, negative_prompt)]),  # [1, 2L]
        "image": 2.0 * image - 1.0,  # [1, 3, H, W] in [-1, 1], the pipeline's normalization
        "noise": torch.randn((1, 2, *latent_shape), generator=generator),  # [1, 2, C, h, w]
        "sigmas": sigmas[None, start:],  # [1, N - start + 1]
        "timesteps": timesteps[None, start:],  # [1, N - start]
        "guidance_scale": torch.tensor([guidance_scale]),  # [1]
        "num_steps": steps - start,
    }


def native_size(walks: SD3Walks) -> int:
    """The image size the transformer was configured for (its ``sample_size`` latents)."""
    pipe = walks.host.pipe
    return int(pipe.transformer.config.sample_size) * int(pipe.vae_scale_factor)


# ----------------------------------------------------------------------------- factories


def walks_for(pipe: Any, t5_len: int) -> tuple[SD3Walks, dict[str, Any]]:
    walks = SD3Walks(pipe, t5_len=t5_len).eval().requires_grad_(False)
    size = native_size(walks)
    image = torch.linspace(0, 1, 3 * size * size).reshape(1, 3, size, size)  # [1, 3, H, W]
    edit = edit_inputs(walks, "a red square", image, steps=4, strength=0.5)
    sample = request_inputs(walks, "a red square", seed=0, steps=2)
    return walks, {**sample, "image": edit["image"], "noise": edit["noise"]}


def tiny() -> tuple[SD3Walks, dict[str, Any]]:
    """Zero-argument factory: ``serve("walkserve.adapters.diffusers_dit:tiny")``."""
    return walks_for(tiny_pipeline(TINY), TINY.t5_len)


def bench() -> tuple[SD3Walks, dict[str, Any]]:
    """The benchmark's larger random pipeline (still CPU-sized)."""
    return walks_for(tiny_pipeline(BENCH), BENCH.t5_len)


def load_pipeline(path: str, t5_len: int = 256) -> tuple[SD3Walks, dict[str, Any]]:
    """A local ``StableDiffusion3Pipeline`` directory (``from_pretrained`` on a path, no hub
    access), without its T5 encoder, as walks with sample inputs."""
    from diffusers import StableDiffusion3Pipeline

    pipe: Any = StableDiffusion3Pipeline.from_pretrained(
        path, text_encoder_3=None, tokenizer_3=None, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    return walks_for(pipe, t5_len)


API_STEPS = 4  # the HTTP routes' fixed settings
API_GUIDANCE = 5.0
API_STRENGTH = 0.6


def api_profile(name: str) -> Any:
    """The HTTP routes' view of ``tiny``/``bench``: ``/v1/images/generations`` runs
    ``generate`` and ``/v1/images/edits`` runs ``edit`` with an empty negative prompt,
    ``API_STEPS`` steps, guidance ``API_GUIDANCE`` (edits: strength ``API_STRENGTH``); the
    seeded noise is drawn by the app as the pipelines draw it (see ``api.profile``)."""
    from walkserve.api.profile import ImageTask, ModelProfile

    factory = name.partition(":")[2]
    builders: dict[str, Callable[[], tuple[SD3Walks, dict[str, Any]]]] = {
        "tiny": tiny,
        "bench": bench,
    }
    if factory not in builders:
        return ModelProfile(name)
    walks, sample = builders[factory]()
    size = native_size(walks)
    gen = request_inputs(walks, "", steps=API_STEPS, guidance_scale=API_GUIDANCE)
    edit = edit_inputs(
        walks,
        "",
        torch.zeros(1, 3, size, size),
        steps=API_STEPS,
        strength=API_STRENGTH,
        guidance_scale=API_GUIDANCE,
    )
    # The app supplies the prompt ids, the image and the seeded noise; the rest is fixed.
    fixed = {
        "generate": {k: v for k, v in gen.items() if k not in ("prompt_ids", "latents")},
        "edit": {k: v for k, v in edit.items() if k not in ("prompt_ids", "image", "noise")},
    }
    return ModelProfile(
        name,
        image=ImageTask(
            walk="generate",
            prompt_input="prompt_ids",
            noise_input="latents",
            noise_shape=tuple(sample["latents"].shape[1:]),
            size=size,
            vocab_size=int(walks.host.pipe.text_encoder.config.vocab_size),
            max_prompt_tokens=2 * walks.shapes.ids_len,
            image_output="image",
            encode=lambda text: prompt_ids(walks, text),
            edit_walk="edit",
            image_input="image",
            extra_inputs=lambda walk: dict(fixed[walk]),
            image_range=(0.0, 1.0),
            edit_noise_input="noise",
            edit_noise_shape=tuple(sample["noise"].shape[1:]),
        ),
    )
