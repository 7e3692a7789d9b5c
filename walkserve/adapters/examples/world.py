"""example-world: an action-conditioned world model that rolls out future frame tokens.

One walk, ``rollout(frames, actions, horizon) -> predicted``:

1. the **frame encoder** (``stateless``) turns the context frames [B, F, 3, 16, 16] into
   tokens [B, F, N, D] (N = 16 patches of 4x4 pixels per frame);
2. the **predictor** (block-causal transformer, ``kv_cache``) prefills its cache with the
   history: context frames 0 .. F-2, each as one block ``[action token | N frame tokens]`` with
   the reserved "no action" id;
3. a DynamicLoop of at most ``horizon`` steps: step k feeds one block (``actions[:, k]`` and the
   current frame's tokens) and predicts the next frame's tokens, which become the current
   frame. The predictor also predicts, from the action token, whether the episode ends there;
   the rollout stops early once every sequence in the batch predicts its end.

    cache:  [a* | f0] [a* | f1]                       (a*: no action; F = 3 context frames)
    step 0:                     [a0 | f2]  -> p0
    step 1:                               [a1 | p0] -> p1      ...  predicted = [p0, p1, ...]

Tokens in one block see each other and every earlier block (``block_size = N + 1``). The end
head is initialised with a bias of ``END_BIAS`` (-4: the episode almost surely goes on), so
the sample request runs the full horizon; raising that bias makes a rollout stop early.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.examples.blocks import (
    StackConfig,
    TransformerStack,
    empty_kv,
    init_weights,
    seeded,
)
from walkserve.capture.api import Input, component, iterations, loop, walk

IMAGE_SIZE = 16
PATCH = 4
TOKENS_PER_FRAME = (IMAGE_SIZE // PATCH) ** 2  # N = 16
NUM_ACTIONS = 4  # action ids 0 .. NUM_ACTIONS - 1
NO_ACTION = NUM_ACTIONS  # reserved id for history frames
ENCODER_CONFIG = StackConfig(dim=32, layers=1, heads=4)
PREDICTOR_CONFIG = StackConfig(dim=32, layers=2, heads=4)
END_BIAS = -4.0
INIT_STD = 0.1
CONTEXT_FRAMES = 3
HORIZON = 6
NUM_SAMPLE_ACTIONS = 8


@component(engine="stateless")
class FrameEncoder(nn.Module):
    """frames [B, F, 3, H, W] -> tokens [B, F, N, D], N = (H / PATCH) * (W / PATCH)."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, cfg.dim, kernel_size=PATCH, stride=PATCH)
        self.stack = TransformerStack(cfg)

    def forward(self, frames: Tensor) -> Tensor:
        b, f = frames.shape[0], frames.shape[1]
        x = self.patch(frames.flatten(0, 1))  # [B*F, D, H/P, W/P]
        x = self.stack.encode(x.flatten(2).transpose(1, 2))  # [B*F, N, D]
        return x.unflatten(0, (b, f))  # [B, F, N, D]


@component(engine="kv_cache")
class Predictor(nn.Module):
    """frame tokens [B, F, N, D], action ids [B, F], past_k/v [layers, B, H, T, hd]
    -> next frame tokens [B, F, N, D], end logits [B, F], new_k/v (T + F * (N + 1)).

    Frame f's block is ``[action_f | frame f's N tokens]``; its outputs predict frame f + 1
    (a residual update of frame f's tokens) and whether the episode ends after it."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.action_embed = nn.Embedding(NUM_ACTIONS + 1, cfg.dim)  # + NO_ACTION
        self.stack = TransformerStack(cfg)
        self.head = nn.Linear(cfg.dim, cfg.dim)
        self.out_norm = nn.LayerNorm(cfg.dim)
        self.end_head = nn.Linear(cfg.dim, 1)

    def forward(
        self, frame_tokens: Tensor, actions: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b, f, n, d = frame_tokens.shape
        act = self.action_embed(actions)[:, :, None]  # [B, F, 1, D]
        x = torch.cat([act, frame_tokens], dim=2).reshape(b, f * (n + 1), d)
        h, new_k, new_v = self.stack(x, past_k, past_v, block_size=n + 1)
        h = h.view(b, f, n + 1, d)
        next_tokens = self.out_norm(frame_tokens + self.head(h[:, :, 1:]))  # [B, F, N, D]
        end_logits = self.end_head(h[:, :, 0]).squeeze(-1)  # [B, F]
        return next_tokens, end_logits, new_k, new_v


class WorldModel(nn.Module):
    """Context frames + actions -> predicted frame tokens, one block per step."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = PREDICTOR_CONFIG
        self.encoder = FrameEncoder(ENCODER_CONFIG)
        self.predictor = Predictor(PREDICTOR_CONFIG)

    @walk(  # any number of context frames and actions (actions ids < NUM_ACTIONS)
        inputs={
            "frames": Input(dims={1: "dynamic"}),
            "actions": Input(dims={1: "dynamic"}, min=0, max=NUM_ACTIONS - 1),
        }
    )
    def rollout(self, frames: Tensor, actions: Tensor, horizon: int) -> dict[str, Tensor]:
        # frames: [B, F, 3, 16, 16] float, F >= 1; actions: [B, A] int64, A >= horizon
        tokens = self.encoder(frames)  # [B, F, N, D]
        history = tokens[:, :-1]  # [B, F-1, N, D]
        no_action = actions.new_full(history.shape[:2], NO_ACTION)  # [B, F-1]
        k_cache, v_cache = empty_kv(self.cfg, frames)  # [layers, B, H, 0, hd]
        _, _, k_cache, v_cache = self.predictor(history, no_action, k_cache, v_cache)
        current = tokens[:, -1]  # [B, N, D]: the last context frame
        preds: list[Tensor] = []
        for k in iterations(horizon):
            k_cache, v_cache, current, done = self.step(k_cache, v_cache, current, actions[:, k])
            preds.append(current)
            if done:
                break
        return {"predicted": torch.stack(preds, dim=1)}  # [B, steps, N, D], steps <= horizon

    @loop(max_iters="horizon")
    def step(
        self, k_cache: Tensor, v_cache: Tensor, frame_tokens: Tensor, action: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # frame_tokens: [B, N, D]; action: [B] int64; the cache grows by one block (N + 1)
        next_tokens, end_logits, k_cache, v_cache = self.predictor(
            frame_tokens[:, None], action[:, None], k_cache, v_cache
        )
        done = (end_logits > 0).all()  # 0-d bool: P(end) > 0.5 for every sequence
        return k_cache, v_cache, next_tokens[:, 0], done


def build(seed: int = 0) -> tuple[WorldModel, dict[str, Any]]:
    """The model with seeded random weights, and the inputs of a sample request."""
    with seeded(seed):
        model = WorldModel()
        init_weights(model, INIT_STD)
        nn.init.constant_(model.predictor.end_head.bias, END_BIAS)
        frames = torch.rand(1, CONTEXT_FRAMES, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1  # [1, F, 3, H, W]
        actions = torch.randint(0, NUM_ACTIONS, (1, NUM_SAMPLE_ACTIONS))  # [1, A]
    model.eval().requires_grad_(False)
    return model, {"frames": frames, "actions": actions, "horizon": HORIZON}
