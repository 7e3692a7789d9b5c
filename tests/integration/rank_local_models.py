"""Small models for the rank-local execution tests, importable by worker processes as
``rank_local_models:FACTORY`` (pytest puts this directory on ``sys.path``; spawned workers
inherit it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from walkserve.capture import component, iterations, loop, walk

WIDTH = 1 << 16  # floats per feature: a [1, 4, WIDTH] float32 tensor is 1 MiB


@component
class Widen(nn.Module):
    """x [B, 4] -> [B, 4, WIDTH]: a large value, made on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(-1.0, 1.0, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x[..., None] * self.scale)


@component
class Step(nn.Module):
    """One step of a loop over the large value: h [B, 4, WIDTH] -> h."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * 1.5 + 0.1)


@component
class Reduce(nn.Module):
    """big [B, 4, WIDTH] -> [B, 4]: small again, read on another rank."""

    def forward(self, big: torch.Tensor) -> torch.Tensor:
        return big.mean(dim=-1)


class TwoStage(nn.Module):
    """``direct``: a value made on rank 0 read on rank 1 (two lone nodes). ``looped``: a loop
    of ``steps`` steps over it on rank 0 (a region), its result read on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.widen, self.step, self.reduce = Widen(), Step(), Reduce()

    @walk
    def direct(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.reduce(self.widen(x))}

    @walk
    def looped(self, x: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
        h = self.widen(x)
        for _ in iterations(steps):
            h = self.cycle(h)
        return {"y": self.reduce(h)}

    @loop
    def cycle(self, h: torch.Tensor) -> torch.Tensor:
        return self.step(h)  # type: ignore[no-any-return]

    @walk
    def mean(self, big: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.reduce(big)}  # a 1 MiB input, a small output


def two_stage() -> tuple[nn.Module, dict[str, Any]]:
    sample = {"x": torch.randn(1, 4), "steps": 3, "big": torch.randn(1, 4, WIDTH)}
    return TwoStage().eval(), sample


@component
class Checked(nn.Module):
    """A step that raises at iteration ``fail_at`` (a request's input): a failure in the
    middle of a region's loop."""

    def forward(self, h: torch.Tensor, k: int, fail_at: int) -> torch.Tensor:
        if k == fail_at:
            raise ValueError(f"step {k} of this request fails, as asked")
        return torch.tanh(h + 0.01 * k)


class Long(nn.Module):
    """``spin``: a long loop on one rank (``steps`` iterations of a small step)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = Checked()

    @walk
    def spin(self, h: torch.Tensor, steps: int, fail_at: int) -> dict[str, torch.Tensor]:
        for k in iterations(steps):
            h = self.turn(h, k, fail_at)
        return {"h": h}

    @loop
    def turn(self, h: torch.Tensor, k: int, fail_at: int) -> torch.Tensor:
        return self.checked(h, k, fail_at)  # type: ignore[no-any-return]


def long() -> tuple[nn.Module, dict[str, Any]]:
    return Long().eval(), {"h": torch.randn(1, 8), "steps": 4, "fail_at": -1}


class Drift(nn.Module):
    """``drift``: a loop whose runs step as a cohort (a carried state and nothing per
    iteration but the state), so a lone request takes the engine's fast lane."""

    def __init__(self) -> None:
        super().__init__()
        self.step = Step()

    @walk
    def drift(self, h: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
        for _ in iterations(steps):
            h = self.advance(h)
        return {"h": h}

    @loop
    def advance(self, h: torch.Tensor) -> torch.Tensor:
        return self.step(h)  # type: ignore[no-any-return]


def drift() -> tuple[nn.Module, dict[str, Any]]:
    return Drift().eval(), {"h": torch.randn(1, 4, 8), "steps": 4}


class Trail(nn.Module):
    """``trail``: ``drift`` keeping every step's state, a client's stream (``states``)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = Step()

    @walk
    def trail(self, h: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
        states = []
        for _ in iterations(steps):
            h = self.advance(h)
            states.append(h)
        return {"states": torch.stack(states, dim=1)}

    @loop
    def advance(self, h: torch.Tensor) -> torch.Tensor:
        return self.step(h)  # type: ignore[no-any-return]


def trail() -> tuple[nn.Module, dict[str, Any]]:
    return Trail().eval(), {"h": torch.randn(1, 8), "steps": 4}
