"""The shape of a pi0.5 policy beyond its PaliGemma backbone: the action chunk, the robot
state and how it is discretised, the prompt budget, the cameras, the flow-matching steps and
the action expert's width. The backbone's own shape is a Hugging Face ``PaliGemmaConfig``;
the expert's Gemma shape is derived from both (``expert_gemma_config``): it must share the
backbone's depth, heads, key/value heads and head size, since its queries attend to the
backbone's keys and values layer by layer."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from transformers import GemmaConfig, PaliGemmaConfig

# pi0.5's sinusoidal timestep features span periods from 4e-3 to 4 (flow time lives in [0, 1]).
TIME_MIN_PERIOD = 4e-3
TIME_MAX_PERIOD = 4.0


@dataclass(frozen=True)
class Pi05Config:
    """pi0.5's own hyper-parameters (the paper's defaults in brackets where they differ).

    ``action_horizon`` [50] actions of ``action_dim`` [32] per chunk; ``state_dim`` [32]
    state values, each discretised into one of ``state_bins`` (256) bins over [-1, 1] and
    fed to the backbone as one token; prompts of at most ``max_prompt_len`` [200 with the
    state] tokens, padded with the backbone's pad id; ``num_cameras`` [3] images per
    observation; ``num_steps`` (10) Euler steps; the expert's ``expert_width`` [1024] and
    ``expert_mlp_dim`` [4096] (Gemma 300M)."""

    action_dim: int = 32
    action_horizon: int = 50
    state_dim: int = 32
    state_bins: int = 256
    max_prompt_len: int = 48
    num_cameras: int = 3
    num_steps: int = 10
    expert_width: int = 1024
    expert_mlp_dim: int = 4096

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Pi05Config.{f.name} must be a positive int, got {value!r}")
        if self.expert_width % 2:
            raise ValueError(
                f"Pi05Config.expert_width ({self.expert_width}) must be even (sin and cos "
                "halves of the timestep features)"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Pi05Config:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown Pi05Config keys {sorted(unknown)}")
        return cls(**data)

    def check_backbone(self, backbone: PaliGemmaConfig) -> None:
        """Refuse a backbone this config cannot sit on, saying what to change."""
        text: Any = backbone.text_config
        vocab = text.vocab_size
        if vocab <= self.state_bins:
            raise ValueError(
                f"the backbone's vocabulary ({vocab}) must be larger than state_bins "
                f"({self.state_bins}): the state tokens are its last {self.state_bins} ids"
            )
        if text.pad_token_id is None:
            raise ValueError("the backbone's text_config needs a pad_token_id (prompt padding)")

    def prefix_len(self, backbone: PaliGemmaConfig) -> int:
        """Tokens in the prefix: every camera's image tokens, the padded prompt, the state."""
        vision: Any = backbone.vision_config
        per_image = (vision.image_size // vision.patch_size) ** 2
        return self.num_cameras * per_image + self.max_prompt_len + self.state_dim


def expert_gemma_config(cfg: Pi05Config, backbone: PaliGemmaConfig) -> GemmaConfig:
    """The action expert's Gemma shape: the backbone's layers, heads, key/value heads, head
    size, RoPE and norm epsilon, with the expert's own width and MLP size (pi0's
    "gemma_300m" beside "gemma_2b")."""
    text: Any = backbone.text_config
    return GemmaConfig(
        vocab_size=1,  # the expert embeds actions, not tokens
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        hidden_size=cfg.expert_width,
        intermediate_size=cfg.expert_mlp_dim,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        hidden_act=text.hidden_act,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters=dict(text.rope_parameters),
        max_position_embeddings=text.max_position_embeddings,
    )
