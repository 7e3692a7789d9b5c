"""Per-request sampling: ``SamplingParams`` and the pure function that turns a step's logits rows
into one token per request.

Owns the logits transforms and the draw; nothing else. What crosses the boundary:

- in: logits ``[batch, vocab]`` (one row per request that samples this step), and per row its
  ``SamplingParams``, its own ``torch.Generator`` (or None: torch's global generator), the
  token ids it has seen (prompt + output so far, for the repetition penalty), the ids it has
  generated (for the presence and frequency penalties and ``min_tokens``) and, for a
  structured-output request, the grammar's mask of allowed ids;
- out: one token id per row; ``token_logprobs`` gives a token's log-probability and the most
  likely alternatives, from the raw logits (before any transform, as vLLM's default and
  OpenAI's ``logprobs`` report them).

Each row is processed on its own and draws only from its own generator, so a seeded request
gets the same tokens whichever requests share its batch. Order of the transforms (vLLM's)::

    logits -> allowed mask (grammar) -> min_tokens (stop ids masked) -> logit_bias
           -> repetition penalty (prompt + output) -> presence / frequency (output only)
           -> (temperature < SAMPLING_EPS: argmax)
           -> / temperature -> top-k -> top-p -> softmax -> draw with the row's generator

The presence and frequency penalties are OpenAI's: with ``c[j]`` the count of token ``j`` among
the generated tokens, ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``.
A temperature below ``SAMPLING_EPS`` (1e-5, vLLM's) is greedy: dividing by it overflows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GREEDY",
    "SAMPLING_EPS",
    "apply_penalties",
    "token_logprobs",
    "SamplingParams",
    "apply_repetition_penalty",
    "sample",
    "sample_row",
    "seeded_token",
    "step_seed",
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
    ``presence_penalty`` / ``frequency_penalty``: OpenAI's, over the generated tokens (0: off;
    each in [-2, 2]). ``min_tokens``: ``stop_token_ids`` cannot be drawn before this many
    tokens were generated. ``logit_bias``: ``(token id, bias)`` pairs added to the logits.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not -100.0 <= b <= 100.0 or t < 0 for t, b in self.logit_bias):
            raise ValueError("logit_bias holds (token id >= 0, bias in [-100, 100]) pairs")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def plain(self) -> bool:
        """No transform before the argmax: a greedy batch of such rows is one argmax."""
        return (
            self.greedy
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.min_tokens == 0
            and not self.logit_bias
        )


SAMPLING_EPS = 1e-5


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


def apply_penalties(
    logits: torch.Tensor,  # [V]
    generated: Sequence[int],
    presence: float,
    frequency: float,
) -> torch.Tensor:  # [V], a new tensor
    """OpenAI's presence and frequency penalties over the ``generated`` token ids."""
    if (presence == 0.0 and frequency == 0.0) or not generated:
        return logits
    ids = torch.tensor(list(generated), dtype=torch.int64, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


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
    generated: Sequence[int] = (),
    allowed: torch.Tensor | None = None,  # [V] bool: the grammar's mask; None: every id
) -> int:
    """One request's next token (see the module docstring for the order of transforms).
    ``generated``: the ids generated so far (a suffix of ``seen``)."""
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if params.min_tokens and len(generated) < params.min_tokens and params.stop_token_ids:
        stops = torch.tensor(params.stop_token_ids, dtype=torch.int64, device=logits.device)
        kept = logits.index_fill(0, stops, float("-inf"))
        if bool(torch.isfinite(kept).any()):  # the grammar may allow a stop id only: it wins
            logits = kept
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device)
        logits = logits.index_add(0, ids, bias)
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = apply_penalties(logits, generated, params.presence_penalty, params.frequency_penalty)
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
    if all(p.plain for p in params):
        return [int(t) for t in logits.argmax(-1).tolist()]  # one device sync for the batch
    return [sample_row(logits[i], params[i], generators[i], seen[i]) for i in range(n)]


def token_logprobs(
    logits: torch.Tensor,  # [V], raw
    token: int,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] float32 log-probabilities, [n] int64 ids)
    """The log-probability of ``token`` (column 0) and of the ``n - 1`` most likely ids
    (columns 1..), from the raw logits; ``n == 0``: empty."""
    if n == 0:
        return torch.empty(0), torch.empty(0, dtype=torch.int64)
    logp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(logp, min(n - 1, logp.shape[-1]))
    ids = torch.cat([torch.tensor([token], device=logp.device), top.indices])
    return torch.cat([logp[token : token + 1], top.values]).cpu(), ids.cpu()


def step_seed(seed: int, row: int, step: int) -> int:
    """The generator seed of one draw: a hash of ``(seed, row, step)``, 63 bits."""
    digest = hashlib.blake2b(f"{seed}:{row}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_token(
    logits: torch.Tensor,  # [V]
    row: int,
    step: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    repetition_penalty: float = 1.0,
    seen: Sequence[int] = (),
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
    generated: Sequence[int] = (),
    logit_bias: tuple[tuple[int, float], ...] = (),
    allowed: torch.Tensor | None = None,
) -> int:
    """One token of row ``row`` at step ``step``: argmax when greedy, else ``sample_row``
    with a generator seeded from ``step_seed(seed, row, step)`` (the rule of every sampling
    component: the draw depends on the request's own inputs only). ``repetition_penalty``
    applies to the token ids in ``seen`` (transformers' rule, before the argmax too); the
    presence and frequency penalties and ``min_tokens`` to ``generated``; ``allowed`` is a
    grammar's mask."""
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        repetition_penalty=repetition_penalty,
        stop_token_ids=stop_ids,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
        logit_bias=logit_bias,
    )
    if params.plain and allowed is None:
        return int(logits.argmax())
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=logits.device).manual_seed(step_seed(seed, row, step))
    return sample_row(logits, params, generator, seen, generated, allowed)
