"""V-JEPA 2-AC: the V-JEPA 2 encoder from transformers and an action-conditioned predictor,
served as rollouts of horizon H with and without KV reuse.

What this module owns: the two rollout walks around the encoder and the action-conditioned
predictor (``vjepa2_ac_predictor``: written from the V-JEPA 2 paper's description, since
transformers ships only the encoder and the masked predictor), a tiny seeded factory ``tiny()``
and a loader for a local checkpoint directory. What crosses its boundary: a decorated
``nn.Module`` and sample inputs (to ``capture.trace`` /
``serve("walkserve.adapters.vjepa2_ac:tiny")``); upstream code is imported, never copied:
``VJEPA2Model`` runs unmodified inside the ``FrameEncoder`` component.

Walk inputs (B requests stacked, F >= 1 context frames, S = state size, A = action size)::

    frames         [B, F, 3, H, W] float   observed frames (the last one is "now")
    states         [B, F, S]       float   end-effector state at each observed frame
    actions        [B, L, A]       float   future actions, L >= horizon (action = state delta)
    goal           [B, 3, H, W]    float   goal image
    goal_tolerance [B]             float   stop once every mean |prediction - goal| < this
    horizon        int                     at most this many predicted frames
    -> predicted   [B, steps, N, D]        predicted encoder tokens, steps <= horizon

The predictor sees one block per time step, ``[action | state | N frame tokens]``; a token of
block t attends to every token of blocks <= t (block-causal). Block t's frame-token outputs
predict frame t + 1. History blocks take the action that led to the next observed state,
``a_t = s_{t+1} - s_t``; in a rollout the state advances by the chosen action, ``s + a``.

    observed: z0 z1 z2 (F = 3), s0 s1 s2          cache after the prefill:
    prefill:  [s1-s0 | s0 | z0] [s2-s1 | s1 | z1]   2 blocks
    step 0:   [a0 | s2 | z2]          -> p3        (s3 = s2 + a0)
    step 1:   [a1 | s3 | p3]          -> p4        ...  predicted = [p3, p4, ...]

``rollout`` (cached) feeds only the newest block per step and carries K/V of every earlier
block as explicit loop state ([layers, B, heads, T, head_dim], T = blocks * (N + 2)).
``rollout_native`` recomputes the predictor over the whole growing prefix at every step (the
baseline: no cache). Positions are absolute (3D RoPE (t, row, col) on frame tokens, 1D RoPE
(t) on action/state tokens), so a cached key equals the key a full recompute would produce
and both walks compute the same function; they differ only by float summation order.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn
from transformers import VJEPA2Config, VJEPA2Model

from walkserve.adapters.vjepa2_ac_predictor import ACPredictor, PredictorConfig
from walkserve.capture.api import Input, component, iterations, loop, walk

PREDICTOR_WEIGHTS = "predictor.safetensors"
PREDICTOR_CONFIG = "predictor_config.json"


# ------------------------------------------------------------------------------ encoder


@component(engine="stateless")
class FrameEncoder(nn.Module):
    """frames [B, F, 3, H, W] -> tokens [B, F, N, D]: each frame on its own, as a clip of
    ``tubelet_size`` copies of itself (V-JEPA 2 patches time in tubelets), through the
    unmodified ``VJEPA2Model`` encoder (its masked predictor is skipped)."""

    def __init__(self, model: VJEPA2Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, frames: Tensor) -> Tensor:
        b, f = frames.shape[0], frames.shape[1]
        clips = frames.flatten(0, 1)[:, None]  # [B*F, 1, 3, H, W]
        clips = clips.expand(-1, self.model.config.tubelet_size, -1, -1, -1)  # [B*F, tub, ...]
        out = self.model(pixel_values_videos=clips, skip_predictor=True)
        return out.last_hidden_state.unflatten(0, (b, f))  # [B, F, N, D]


# -------------------------------------------------------------------------------- model


# frames [B, F, C, H, W] and states [B, F, S]: any number of context frames; actions
# [B, K, A]: at least the horizon.
ROLLOUT_INPUTS = {
    "frames": Input(dims={1: "dynamic"}),
    "states": Input(dims={1: "dynamic"}),
    "actions": Input(dims={1: "dynamic"}),
}


class VJEPA2AC(nn.Module):
    """Encoder + predictor with two rollout walks (see the module docstring)."""

    def __init__(self, encoder: VJEPA2Model, predictor_cfg: PredictorConfig) -> None:
        super().__init__()
        enc = encoder.config
        grid = encoder_grid(enc)
        if predictor_cfg.embed_dim != enc.hidden_size or predictor_cfg.grid != grid:
            raise ValueError(
                f"predictor expects embed_dim={predictor_cfg.embed_dim}, grid="
                f"{predictor_cfg.grid}; the encoder gives {enc.hidden_size} and {grid}"
            )
        self.encoder = FrameEncoder(encoder)
        self.predictor = ACPredictor(predictor_cfg)

    def _encode(self, frames: Tensor, goal: Tensor) -> tuple[Tensor, Tensor]:
        tokens = self.encoder(torch.cat([frames, goal[:, None]], dim=1))  # [B, F + 1, N, D]
        return tokens[:, :-1], tokens[:, -1]  # [B, F, N, D], [B, N, D]

    @walk(inputs=ROLLOUT_INPUTS)
    def rollout(
        self,
        frames: Tensor,
        states: Tensor,
        actions: Tensor,
        goal: Tensor,
        goal_tolerance: Tensor,
        horizon: int,
    ) -> dict[str, Tensor]:
        tokens, goal_tokens = self._encode(frames, goal)
        history_actions = states[:, 1:] - states[:, :-1]  # [B, F-1, A]
        k_cache, v_cache = self.predictor.empty_cache(frames)
        _, k_cache, v_cache = self.predictor(
            tokens[:, :-1], history_actions, states[:, :-1], k_cache, v_cache
        )  # cache: F-1 blocks
        current, state = tokens[:, -1], states[:, -1]  # [B, N, D], [B, S]
        preds: list[Tensor] = []
        for k in iterations(horizon):
            k_cache, v_cache, current, state, done = self.cached_step(
                k_cache, v_cache, current, state, actions[:, k], goal_tokens, goal_tolerance
            )
            preds.append(current)
            if done:
                break
        return {"predicted": torch.stack(preds, dim=1)}  # [B, steps, N, D]

    @loop(max_iters="horizon")
    def cached_step(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        frame_tokens: Tensor,
        state: Tensor,
        action: Tensor,
        goal_tokens: Tensor,
        goal_tolerance: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # frame_tokens: [B, N, D]; state, action: [B, S]; the cache grows by one block
        nxt, k_cache, v_cache = self.predictor(
            frame_tokens[:, None], action[:, None], state[:, None], k_cache, v_cache
        )
        nxt = nxt[:, 0]  # [B, N, D]
        return k_cache, v_cache, nxt, state + action, at_goal(nxt, goal_tokens, goal_tolerance)

    @walk(inputs=ROLLOUT_INPUTS)
    def rollout_native(
        self,
        frames: Tensor,
        states: Tensor,
        actions: Tensor,
        goal: Tensor,
        goal_tolerance: Tensor,
        horizon: int,
    ) -> dict[str, Tensor]:
        tokens, goal_tokens = self._encode(frames, goal)
        past_actions = states[:, 1:] - states[:, :-1]  # [B, F-1, A]
        empty_k, empty_v = self.predictor.empty_cache(frames)
        seq, seq_states = tokens, states  # [B, F, N, D], [B, F, S]: grow by one per step
        preds: list[Tensor] = []
        for k in iterations(horizon):
            seq, past_actions, seq_states, nxt, done = self.native_step(
                seq,
                past_actions,
                seq_states,
                actions[:, k],
                empty_k,
                empty_v,
                goal_tokens,
                goal_tolerance,
            )
            preds.append(nxt)
            if done:
                break
        return {"predicted": torch.stack(preds, dim=1)}  # [B, steps, N, D]

    @loop(max_iters="horizon")
    def native_step(
        self,
        seq: Tensor,
        past_actions: Tensor,
        seq_states: Tensor,
        action: Tensor,
        empty_k: Tensor,
        empty_v: Tensor,
        goal_tokens: Tensor,
        goal_tolerance: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # seq: [B, T, N, D] every frame so far; past_actions: [B, T-1, A]; seq_states: [B, T, S]
        all_actions = torch.cat([past_actions, action[:, None]], dim=1)  # [B, T, A]
        out, _, _ = self.predictor(seq, all_actions, seq_states, empty_k, empty_v)
        nxt = out[:, -1]  # [B, N, D]: the last block's prediction
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        seq_states = torch.cat([seq_states, (seq_states[:, -1] + action)[:, None]], dim=1)
        return seq, all_actions, seq_states, nxt, at_goal(nxt, goal_tokens, goal_tolerance)


def at_goal(pred: Tensor, goal_tokens: Tensor, tolerance: Tensor) -> Tensor:
    """0-d bool: every sequence's mean |pred - goal| (pred, goal [B, N, D]) is < tolerance [B]."""
    return ((pred - goal_tokens).abs().mean(dim=(1, 2)) < tolerance).all()


# --------------------------------------------------------------------- building, loading


def encoder_grid(cfg: VJEPA2Config) -> int:
    """Patches per side of a square ``VJEPA2Config`` with an int ``patch_size``."""
    if not isinstance(cfg.patch_size, int) or cfg.crop_size % cfg.patch_size:
        raise ValueError(
            f"the encoder needs an int patch_size dividing crop_size {cfg.crop_size}, got "
            f"{cfg.patch_size!r}"
        )
    return cfg.crop_size // cfg.patch_size


def tiny_encoder_config(crop_size: int = 16, patch_size: int = 4, hidden: int = 48) -> VJEPA2Config:
    """A small ``VJEPA2Config`` (one tubelet of 2 frames; a 1-layer masked predictor that the
    rollouts never run)."""
    return VJEPA2Config(
        patch_size=patch_size,
        crop_size=crop_size,
        frames_per_clip=2,
        tubelet_size=2,
        hidden_size=hidden,
        num_attention_heads=4,
        num_hidden_layers=2,
        mlp_ratio=2.0,
        pred_hidden_size=16,
        pred_num_attention_heads=2,
        pred_num_hidden_layers=1,
        pred_num_mask_tokens=2,
        num_pooler_layers=1,
    )


def build(
    encoder_cfg: VJEPA2Config, predictor_cfg: PredictorConfig | None = None, seed: int = 0
) -> VJEPA2AC:
    """The model with seeded random weights, in eval mode without gradients."""
    grid = encoder_grid(encoder_cfg)
    pcfg = predictor_cfg or PredictorConfig(embed_dim=encoder_cfg.hidden_size, grid=grid)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VJEPA2AC(VJEPA2Model(encoder_cfg), pcfg)
    return model.eval().requires_grad_(False)


def sample_inputs(
    model: VJEPA2AC, batch: int = 1, context: int = 2, horizon: int = 6, seed: int = 0
) -> dict[str, Any]:
    """A request: ``context`` frames and states, ``horizon`` actions, a goal that is never
    reached (tolerance 0), so the rollout runs the full horizon."""
    size = model.encoder.model.config.crop_size
    pcfg = model.predictor.cfg
    g = torch.Generator().manual_seed(seed)
    return {
        "frames": torch.rand(batch, context, 3, size, size, generator=g) * 2 - 1,
        "states": torch.randn(batch, context, pcfg.state_dim, generator=g),
        "actions": 0.1 * torch.randn(batch, horizon, pcfg.action_dim, generator=g),
        "goal": torch.rand(batch, 3, size, size, generator=g) * 2 - 1,
        "goal_tolerance": torch.zeros(batch),
        "horizon": horizon,
    }


def tiny() -> tuple[VJEPA2AC, dict[str, Any]]:
    """Zero-argument factory for ``serve("walkserve.adapters.vjepa2_ac:tiny")``: 16x16 frames,
    16 tokens per frame, seeded weights (every worker process builds the same model). The
    predictor is narrow (dim 32, 2 layers: 4.6 KB of K per block) so that a served cache
    of up to 14 blocks travels inline between processes (see HELPER_NOTES.md on shm slots)."""
    enc = tiny_encoder_config()
    pcfg = PredictorConfig(embed_dim=enc.hidden_size, grid=encoder_grid(enc), dim=32, heads=2)
    model = build(enc, pcfg)
    return model, sample_inputs(model)


def medium() -> tuple[VJEPA2AC, dict[str, Any]]:
    """Zero-argument factory of the benchmark's CPU-friendly but non-trivial config: 32x32
    frames in 64 tokens of 128 (a 2-layer encoder), a 4.8M-parameter predictor (dim 256, 6
    layers, 8 heads), 66 tokens per block."""
    enc = tiny_encoder_config(crop_size=32, patch_size=4, hidden=128)
    pcfg = PredictorConfig(embed_dim=128, grid=encoder_grid(enc), dim=256, layers=6, heads=8)
    model = build(enc, pcfg)
    return model, sample_inputs(model)


def save_checkpoint(model: VJEPA2AC, path: str) -> None:
    """Write ``path``: the encoder as a Hugging Face ``VJEPA2Model`` directory (config.json,
    model.safetensors), the predictor as ``predictor.safetensors`` + ``predictor_config.json``."""
    from safetensors.torch import save_file

    model.encoder.model.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.predictor.state_dict().items()}
    save_file(state, os.path.join(path, PREDICTOR_WEIGHTS))
    with open(os.path.join(path, PREDICTOR_CONFIG), "w") as f:
        json.dump(asdict(model.predictor.cfg), f, indent=2)


def load_checkpoint(path: str) -> VJEPA2AC:
    """Read a directory written by ``save_checkpoint`` (encoder via
    ``VJEPA2Model.from_pretrained(path)``); every predictor weight must be present."""
    from safetensors.torch import load_file

    names = (PREDICTOR_WEIGHTS, PREDICTOR_CONFIG)
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise ValueError(f"{path} is not a V-JEPA 2-AC checkpoint: it lacks {missing}")
    with open(os.path.join(path, PREDICTOR_CONFIG)) as f:
        pcfg = PredictorConfig.from_dict(json.load(f))
    encoder = VJEPA2Model.from_pretrained(path)
    model = VJEPA2AC(encoder, pcfg)
    model.predictor.load_state_dict(load_file(os.path.join(path, PREDICTOR_WEIGHTS)))  # strict
    return model.eval().requires_grad_(False)


def from_checkpoint(path: str) -> tuple[VJEPA2AC, dict[str, Any]]:
    """``(model, sample_inputs)`` for a checkpoint directory (for a ``module:factory`` entry
    that fixes the path)."""
    model = load_checkpoint(path)
    return model, sample_inputs(model)


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = [
    "FrameEncoder",
    "VJEPA2AC",
    "build",
    "from_checkpoint",
    "load_checkpoint",
    "sample_inputs",
    "save_checkpoint",
    "medium",
    "tiny",
    "tiny_encoder_config",
]
