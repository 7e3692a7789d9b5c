"""``TokenSampler``: the token pick of the speech adapters' decode loops (Orpheus, Qwen2.5-Omni,
Qwen3-Omni) as a small stateless component, so that a walk can sample per request with the
runtime's own rule (``walkserve.runtime.kv.paged_lm.seeded_token``: argmax at temperature 0,
else top-k / top-p sampling from a generator seeded by ``(seed, row, step)``).

What crosses its boundary: ``logits`` [B, 1, V] (any masking already applied by the walk),
``step`` [B, 1] int64 or an int (the row's draw index: tokens this sampler drew for it before),
the request's scalars ``temperature``, ``top_p``, ``top_k``, ``seed``, and optionally
``repetition_penalty`` with ``seen`` [B, V] bool (the token ids generate() would penalize: the
prompt's and the ones drawn so far; the walk carries it); out: tokens [B, 1] int64.

Why a component and not walk glue: a draw is a Python loop over rows with a generator per row,
which fx cannot trace; and batching must not change a request's tokens. ``forward_batch`` gets
every request's call of a batch separately, so row ``r`` is the row inside its own request,
never its position in the batch. At temperature 0 the pick is ``logits.argmax(-1)``, the same
op the walks used before, so greedy outputs are unchanged bit for bit.

Several samplers of one request (thinker, talker, code predictor) draw independent streams:
each has its own ``stream`` number, folded into the step index
(``step * STREAMS + stream``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from walkserve.capture.api import component
from walkserve.runtime.kv.paged_lm import seeded_token

__all__ = ["STREAMS", "SamplingDefaults", "TokenSampler"]

STREAMS = 8  # distinct sampler streams of one request


@dataclass(frozen=True)
class SamplingDefaults:
    """An upstream model's default generation settings for one sampler, for profiles that want
    the model's own behaviour instead of the walks' greedy default (temperature 0).
    ``repetition_penalty``: applied where the walk carries the token history (``seen``)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling defaults {self}")


@component(engine="stateless")
class TokenSampler(nn.Module):
    """One token per row of a step's logits (see the module docstring)."""

    def __init__(self, stream: int = 0) -> None:
        super().__init__()
        if not 0 <= stream < STREAMS:
            raise ValueError(f"stream must be in 0..{STREAMS - 1}, got {stream}")
        self.stream = stream

    def forward(
        self,
        logits: Tensor,  # [B, 1, V]
        step: Tensor | int,  # [B, 1] int64, or one int for every row
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        repetition_penalty: float = 1.0,
        seen: Tensor | None = None,  # [B, V] bool: token ids the penalty applies to
    ) -> Tensor:  # [B, 1] int64
        if temperature == 0.0 and repetition_penalty == 1.0:
            return logits.argmax(-1)
        rows = logits.reshape(logits.shape[0], -1)  # [B, V]
        steps = step.reshape(-1).tolist() if isinstance(step, Tensor) else [step] * len(rows)
        picked = [
            seeded_token(
                rows[r],
                r,
                int(steps[r]) * STREAMS + self.stream,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                seed=int(seed),
                repetition_penalty=float(repetition_penalty),
                seen=[] if seen is None else seen[r].nonzero().flatten().tolist(),
            )
            for r in range(rows.shape[0])
        ]
        return torch.tensor(picked, dtype=torch.int64, device=logits.device).unsqueeze(1)

    def forward_batch(self, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> list[Tensor]:
        """Each request's call on its own: rows are numbered within their request."""
        return [self(*args, **kwargs) for args, kwargs in calls]
