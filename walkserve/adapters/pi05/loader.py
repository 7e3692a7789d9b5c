"""Building, saving and loading pi0.5 policies: tiny seeded instances for tests and the
benchmark, sample requests, and a checkpoint directory layout.

Checkpoint directory (``save_checkpoint`` / ``load_checkpoint``)::

    config.json, model.safetensors    the backbone, as ``PaliGemmaModel.save_pretrained`` writes it
    pi05_config.json                  ``Pi05Config`` fields
    expert.safetensors                the action expert's weights (every one required)

``tiny()`` and ``medium()`` are zero-argument factories (``serve("walkserve.adapters.pi05:tiny")``,
``walkserve serve --model tiny-pi05``): every worker process builds the same seeded weights.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaModel, SiglipVisionConfig

from walkserve.adapters.pi05.config import Pi05Config
from walkserve.adapters.pi05.walks import Pi05Policy

PI05_CONFIG = "pi05_config.json"
EXPERT_WEIGHTS = "expert.safetensors"
EXPERT_INIT_GAIN = 1.2
TINY = Pi05Config(
    action_dim=6,
    action_horizon=8,
    state_dim=8,
    max_prompt_len=12,
    num_cameras=2,
    expert_width=32,
    expert_mlp_dim=64,
)
MEDIUM = Pi05Config(
    action_dim=32,
    action_horizon=50,
    state_dim=32,
    max_prompt_len=48,
    num_cameras=2,
    expert_width=128,
    expert_mlp_dim=512,
)


def backbone_config(
    *,
    image_size: int = 32,
    patch_size: int = 8,
    vision_width: int = 32,
    vision_layers: int = 1,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 16,
    mlp_dim: int = 128,
    vocab: int = 1024,
) -> PaliGemmaConfig:
    """A small ``PaliGemmaConfig`` (SigLIP vision tower, Gemma with one key/value head as
    PaliGemma 3B has). Initialised with std 0.1 rather than 0.02, so that random prompts,
    images and states move the actions visibly."""
    vision = SiglipVisionConfig(
        hidden_size=vision_width,
        intermediate_size=2 * vision_width,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
    )
    text = GemmaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=mlp_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        pad_token_id=0,
        initializer_range=0.1,
    )
    return PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=width)


def build(backbone: PaliGemmaConfig, cfg: Pi05Config, seed: int = 0) -> Pi05Policy:
    """The policy with seeded random weights, in eval mode without gradients. The expert's
    linear weights are drawn with std ``EXPERT_INIT_GAIN / sqrt(fan_in)`` and zero biases:
    PyTorch's default init leaves its attention to the prefix nearly uniform (the observation
    then moves a random policy's actions by ~1%; with this, by 2-20%), and a fixed std grows
    activations with the width until ten Euler steps amplify float32 rounding (a batch of
    rows then differs from the rows alone by 1e-3 at width 128; with this, by ~3e-7)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = Pi05Policy(PaliGemmaModel(backbone), cfg)
        for module in policy.expert.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=EXPERT_INIT_GAIN / math.sqrt(module.in_features))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return policy.eval().requires_grad_(False)


def sample_inputs(
    policy: Pi05Policy, batch: int = 1, prompt_len: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """A request of ``batch`` observations: random images in [-1, 1], prompts of
    ``prompt_len`` tokens (default: the budget less 2; the last row's prompt ends in one
    padding token), states in [-1, 1] and noise, all from ``seed``."""
    cfg = policy.cfg
    prefix = policy.prefix
    length = cfg.max_prompt_len - 2 if prompt_len is None else prompt_len
    g = torch.Generator().manual_seed(seed)
    size = prefix.image_size
    prompt = torch.randint(1, prefix.state_base, (batch, length), generator=g)
    if length > 1:
        prompt[-1, -1] = prefix.pad_id
    return {
        "images": torch.rand(batch, cfg.num_cameras, 3, size, size, generator=g) * 2 - 1,
        "prompt_ids": prompt,
        "state": torch.rand(batch, cfg.state_dim, generator=g) * 2 - 1,
        "noise": torch.randn(batch, cfg.action_horizon, cfg.action_dim, generator=g),
    }


def tiny() -> tuple[Pi05Policy, dict[str, Any]]:
    """Zero-argument factory of the test model: 2 cameras of 32x32 (16 tokens each), a
    2-layer Gemma of width 64, an expert of width 32, chunks of 8 actions of 6."""
    policy = build(backbone_config(), TINY)
    return policy, sample_inputs(policy)


def medium() -> tuple[Pi05Policy, dict[str, Any]]:
    """Zero-argument factory of the benchmark's CPU-sized model: 2 cameras of 64x64 (64
    tokens each from a 2-layer SigLIP of width 128), a 4-layer Gemma of width 256 (8 heads of
    32, one key/value head), pi0's chunk of 50 actions of 32 from an expert of width 128."""
    backbone = backbone_config(
        image_size=64,
        vision_width=128,
        vision_layers=2,
        width=256,
        layers=4,
        heads=8,
        head_dim=32,
        mlp_dim=1024,
        vocab=4096,
    )
    policy = build(backbone, MEDIUM)
    return policy, sample_inputs(policy)


def save_checkpoint(policy: Pi05Policy, path: str) -> None:
    """Write ``path`` in the layout of the module docstring."""
    from safetensors.torch import save_file

    policy.prefix.paligemma.save_pretrained(path)
    state = {k: v.contiguous() for k, v in policy.expert.state_dict().items()}
    save_file(state, os.path.join(path, EXPERT_WEIGHTS))
    with open(os.path.join(path, PI05_CONFIG), "w") as f:
        json.dump(asdict(policy.cfg), f, indent=2)


def load_checkpoint(path: str) -> Pi05Policy:
    """Read a directory written by ``save_checkpoint``; refuse one that lacks a file or an
    expert weight."""
    from safetensors.torch import load_file

    names = ("config.json", PI05_CONFIG, EXPERT_WEIGHTS)
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise ValueError(f"{path} is not a pi0.5 checkpoint: it lacks {missing}")
    with open(os.path.join(path, PI05_CONFIG)) as f:
        cfg = Pi05Config.from_dict(json.load(f))
    policy = Pi05Policy(PaliGemmaModel.from_pretrained(path), cfg)
    policy.expert.load_state_dict(load_file(os.path.join(path, EXPERT_WEIGHTS)))  # strict
    return policy.eval().requires_grad_(False)


def from_checkpoint(path: str) -> tuple[Pi05Policy, dict[str, Any]]:
    """``(policy, sample_inputs)`` for a checkpoint directory (the registry's loader)."""
    policy = load_checkpoint(path)
    return policy, sample_inputs(policy)


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
