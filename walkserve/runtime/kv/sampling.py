"""Per-request sampling: ``SamplingParams`` and the pure function that turns a step's logits rows
into one token per request.

Owns the logits transforms and the draw; nothing else. What crosses the boundary:

- in: logits ``[batch, vocab]`` (one row per request that samples this step), and per row its
  ``SamplingParams``, its own ``torch.Generator`` (or None: torch's global generator) and the
  token ids it has seen (prompt + output so far, for the repetition penalty);
- out: one token id per row.

Each row is processed on its own and draws only from its own generator, so a seeded request
gets the same tokens whichever requests share its batch. Order of the transforms, as in
transformers' ``generate``::

    logits -> repetition penalty -> (temperature == 0: argmax)
           -> / temperature -> top-k -> top-p -> softmax -> draw with the row's generator
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GREEDY",
    "SamplingParams",
    "apply_repetition_penalty",
    "sample",
    "sample_row",
    "top_k_filter",
    "top_p_filter",
]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature``: 0 is greedy (argmax). ``top_p``: keep the smallest set of most likely
    tokens whose probability mass is >= top_p (1: off). ``top_k``: keep the k most likely
    tokens (0: off). ``repetition_penalty``: transformers' rule over the prompt and output so
    far (1: off). ``seed``: seeds the request's own generator; None: not reproducible.
    ``stop_token_ids``: the request finishes after sampling one of them (it is kept).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple, got {self.stop_token_ids!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def apply_repetition_penalty(
    logits: torch.Tensor,  # [V]
    seen: Sequence[int],
    penalty: float,
) -> torch.Tensor:  # [V], a new tensor
    """transformers' rule: for every token in ``seen``, a positive logit is divided by
    ``penalty`` and a negative one multiplied by it."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), dtype=torch.int64, device=logits.device)
    score = logits[ids]
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.index_copy(0, ids, score)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:  # [V] -> [V]
    """Set every logit below the k-th largest to -inf (ties with the k-th are kept)."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:  # [V] -> [V]
    """Keep the smallest set of most likely tokens whose mass is >= p; the rest -> -inf.

    Sorted by probability, descending, token i is kept iff the mass before it is < p::

        probs     0.5   0.3   0.15  0.05        p = 0.7
        before    0.0   0.5   0.8   0.95
        kept      x     x     .     .
    """
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits.double(), -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, 0) - sorted_probs  # [V]: mass of the tokens before
    drop_sorted = before >= p
    drop_sorted[0] = False  # the most likely token is always kept
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(
    logits: torch.Tensor,  # [V]
    params: SamplingParams,
    generator: torch.Generator | None,
    seen: Sequence[int],
) -> int:
    """One request's next token (see the module docstring for the order of transforms)."""
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor,  # [B, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen: Sequence[Sequence[int]],
) -> list[int]:  # [B] token ids
    """One token per row; row i uses only ``params[i]``, ``generators[i]`` and ``seen[i]``."""
    n = logits.shape[0]
    if not len(params) == len(generators) == len(seen) == n:
        raise ValueError(
            f"{n} logits rows need as many params, generators and seen lists, got "
            f"{len(params)}, {len(generators)}, {len(seen)}"
        )
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        return [int(t) for t in logits.argmax(-1).tolist()]  # one device sync for the batch
    return [sample_row(logits[i], params[i], generators[i], seen[i]) for i in range(n)]
