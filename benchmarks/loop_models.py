"""The two plain PyTorch loops of ``bench_loops.py``, decorated the way the README shows, as a
new user would write them; importable by worker processes as ``loop_models:FACTORY`` (the
bench script's directory is on their ``sys.path``).

- ``rollout``: a small action-conditioned predictor (an MLP world model, width 256) rolled out
  for ``horizon`` steps from a start state, one action per step.
- ``speech``: a recurrent LM (a GRU cell, vocabulary 256, width 256) emitting ``steps``
  tokens greedily, streamed into a sliding-window decoder (``SlidingWindow(16, 8)``: an MLP
  over 16 token embeddings every 8 tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from walkserve.capture import Input, component, iterations, loop, stream, walk
from walkserve.capture.chunk import EndOfStream, SlidingWindow

DIM = 256
VOCAB = 256
WINDOW, HOP = 16, 8


@component
class Predictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Embedding(16, DIM)
        self.net = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return state + self.net(torch.tanh(state + self.act(action)))  # [B, DIM]


class Rollout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.predictor = Predictor()

    @walk(inputs={"actions": Input(dims={1: "dynamic"})})  # one action per step: any horizon
    def rollout(self, state: torch.Tensor, actions: torch.Tensor, horizon: int) -> dict[str, Any]:
        states = []
        for k in iterations(horizon):
            state = self.step(state, actions[:, k])
            states.append(state)
        return {"states": torch.stack(states, dim=1)}  # [B, horizon, DIM]

    @loop
    def step(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.predictor(state, action)  # type: ignore[no-any-return]


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.gru = nn.GRUCell(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.gru(self.embed(token[:, 0]), h)  # token [B, 1] -> h [B, DIM]
        return self.head(h).argmax(-1, keepdim=True), h  # next token [B, 1]


@component
class WindowDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.net = nn.Sequential(nn.Linear(WINDOW * 32, DIM), nn.GELU(), nn.Linear(DIM, 4 * HOP))

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(window).flatten(1))  # [B, WINDOW] -> [B, 4 * HOP] samples


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = Cell()
        self.decoder = WindowDecoder()

    @walk
    def speak(self, token: torch.Tensor, h: torch.Tensor, steps: int) -> dict[str, Any]:
        tokens = []
        for _ in iterations(steps):
            token, h = self.think(token, h)
            tokens.append(token)
        seq = torch.cat(tokens, dim=1)  # [B, steps]
        audio = [
            self.decode(w) for w in stream(seq, SlidingWindow(WINDOW, HOP, EndOfStream.PAD), dim=1)
        ]
        return {"tokens": seq, "audio": torch.cat(audio, dim=1)}

    @loop
    def think(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token, h = self.cell(token, h)
        return token, h

    @loop
    def decode(self, window: torch.Tensor) -> torch.Tensor:
        return self.decoder(window)  # type: ignore[no-any-return]


def rollout() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = Rollout().eval().requires_grad_(False)
    return model, rollout_inputs(0, 4)


def rollout_inputs(seed: int, horizon: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state": torch.randn(1, DIM, generator=g),
        "actions": torch.randint(0, 16, (1, horizon), generator=g),
        "horizon": horizon,
    }


def speech() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = Speech().eval().requires_grad_(False)
    return model, speech_inputs(0, 24)


def speech_inputs(seed: int, steps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "token": torch.randint(0, VOCAB, (1, 1), generator=g),
        "h": torch.randn(1, DIM, generator=g),
        "steps": steps,
    }
