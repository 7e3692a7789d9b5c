"""Tiny random-weight ``StableDiffusion3Pipeline``s built in code (nothing downloaded), for tests,
examples and the image benchmark: ``tiny_pipeline(cfg)`` assembles the upstream parts the SD3
walks (``diffusers_dit``) run, with seeded random weights:

    text encoders  two CLIPTextModelWithProjection (``text_dim`` wide, ``text_layers`` deep)
                   sharing one byte-level CLIP tokenizer (``byte_level_tokenizer``: 514 ids)
    transformer    SD3Transformer2DModel (``layers`` blocks of ``heads`` x ``head_dim``,
                   patch 1, 4 latent channels, ``latent_size`` latents)
    vae            AutoencoderKL (2 blocks, 4 latent channels; images 2 * ``latent_size``)
    scheduler      FlowMatchEulerDiscreteScheduler(shift=3.0); no T5 (``text_encoder_3=None``)

``TINY`` is what ``diffusers_dit:tiny`` serves, ``BENCH`` the benchmark's ``diffusers_dit:bench``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BENCH", "TINY", "TinyConfig", "byte_level_tokenizer", "tiny_pipeline"]


@dataclass(frozen=True)
class TinyConfig:
    """A random SD3 pipeline built in code (no downloads)."""

    text_dim: int = 32
    text_layers: int = 2
    ids_len: int = 16
    t5_len: int = 8
    heads: int = 4
    head_dim: int = 8
    layers: int = 2
    latent_size: int = 16  # latents h = w; images are latent_size * 2 pixels
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.text_dim, self.text_layers, self.ids_len, self.layers, self.latent_size) < 1:
            raise ValueError(f"every TinyConfig size must be >= 1: {self}")


TINY = TinyConfig()
BENCH = TinyConfig(text_dim=64, heads=8, head_dim=16, layers=4, latent_size=16)


def byte_level_tokenizer(max_length: int) -> Any:
    """A CLIP tokenizer with one token per byte (no merges), built in code: the byte-to-unicode
    alphabet CLIP's BPE starts from, each symbol also in its word-final form, and CLIP's two
    special tokens (514 ids)."""
    from transformers import CLIPTokenizer

    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    }
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_pipeline(cfg: TinyConfig = TINY) -> Any:
    """A ``StableDiffusion3Pipeline`` of seeded random tiny parts (no T5)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tok = byte_level_tokenizer(cfg.ids_len)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        clip = CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=cfg.text_dim,
            intermediate_size=2 * cfg.text_dim,
            num_hidden_layers=cfg.text_layers,
            num_attention_heads=4,
            projection_dim=cfg.text_dim,
            max_position_embeddings=cfg.ids_len,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
            hidden_act="gelu",
        )
        text_encoder = CLIPTextModelWithProjection(clip)
        text_encoder_2 = CLIPTextModelWithProjection(clip)
        transformer: Any = SD3Transformer2DModel(
            sample_size=cfg.latent_size,
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=cfg.layers,
            attention_head_dim=cfg.head_dim,
            num_attention_heads=cfg.heads,
            joint_attention_dim=2 * cfg.text_dim,
            caption_projection_dim=cfg.heads * cfg.head_dim,
            pooled_projection_dim=2 * cfg.text_dim,
            pos_embed_max_size=cfg.latent_size,
        )
        vae: Any = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=2 * cfg.latent_size,
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=1.5035,
            shift_factor=0.0609,
        )
    pipe: Any = StableDiffusion3Pipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tok,
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
