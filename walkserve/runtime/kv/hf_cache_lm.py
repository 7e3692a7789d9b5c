"""``HFCacheLM``: the fallback text engine for the Hugging Face causal LMs the paged pool cannot
express exactly (recurrent or linear-attention hybrids, attention computed outside transformers'
attention interface, ALiBi): the model's own forward and its own cache, one per request, as
``generate()`` runs it. Exact, and slower: requests do not share a forward.

Same calling convention as ``paged_lm.PagedLM`` (so the text walks take either):

- in: ``lm(input_ids [B, T], cache, step, temperature, top_p, top_k, seed, repetition_penalty)``
  per request, ``cache`` None for a new request (prefill) or the ``HFCache`` an earlier call
  returned, and ``PagedLM``'s further sampling keywords (penalties, ``min_tokens``,
  ``constraints``, ``logprobs``, ``with_logprobs``);
- out: ``(token [B, 1] int64, cache)``: the token sampled after each row's last input token,
  and the same ``HFCache``, updated in place; with ``with_logprobs`` also the logprob outputs.

Batching: ``forward_batch`` runs every call of a ready batch on its own, one forward each.
(Left to the runtime's grouping, two new requests with prompts of one length would be joined
into one call, and the one cache object it returns would be handed to both.)

The ``HFCache`` holds the model's cache object (``DynamicCache`` or whatever the model makes for
itself, e.g. a hybrid's recurrent state) and each row's tokens so far, for a repetition penalty.
It never leaves the worker (the runtime's ``ObjectRef``); its memory goes when the request's last
reference to it does. Sampling is ``paged_lm.seeded_token``, the rule of every text engine: a
request's tokens depend on its own inputs only; what a request's rows keep between calls (the
prompt length, a logit bias, a grammar) is ``row_sampling.RowState``, as in ``PagedLM``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from walkserve.runtime.kv import grammar
from walkserve.runtime.kv.engine_report import EngineChoice
from walkserve.runtime.kv.row_sampling import RowState, TextSampler, vocab_size

__all__ = ["HFCache", "HFCacheLM"]


class HFCache:
    """One request's cache in an ``HFCacheLM``: the model's own cache and each row's tokens."""

    def __init__(self, owner: HFCacheLM, rows: int) -> None:
        self.owner = owner
        self.past: Any = None  # the model's cache object, after the first forward
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.sampling = [RowState() for _ in range(rows)]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        """Tokens fed so far (every row alike)."""
        return len(self.tokens[0])

    def __repr__(self) -> str:
        return f"HFCache(rows={len(self)}, tokens={self.length})"


class HFCacheLM(nn.Module):
    """``lm`` (a transformers ``*ForCausalLM``, any attention implementation but the paged one)
    run with its own per-request cache; see the module docstring."""

    def __init__(
        self,
        lm: nn.Module,
        reason: str | None = None,
        *,
        stop_ids: Sequence[int] = (),
        vocabulary: grammar.Vocabulary | None = None,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.sampler = TextSampler(stop_ids, vocabulary)
        self.engine_choice = EngineChoice("hf-cache", type(lm).__name__, reason)
        params = inspect.signature(lm.forward).parameters
        self._takes_positions = "position_ids" in params
        # transformers 5 renames past_key_values to cache (both accepted for now).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward_batch(
        self, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]
    ) -> list[tuple[torch.Tensor, HFCache]]:
        """Each call of a ready batch, one forward each (its own cache)."""
        return [self(*args, **kwargs) for args, kwargs in calls]

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        cache: HFCache | None = None,
        step: int | torch.Tensor = 0,  # int, or [B, 1]: tokens generated before this call
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        min_tokens: int = 0,
        constraints: torch.Tensor | None = None,
        logprobs: int = 0,
        with_logprobs: bool = False,
    ) -> Any:  # (token [B, 1] int64, cache[, logprobs [B, 1, n], logprob_ids [B, 1, n]])
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.shape[1] < 1
        ):
            raise ValueError(f"input_ids must be [batch, tokens >= 1], got {_shape(input_ids)}")
        rows, new = input_ids.shape
        if cache is None:
            cache = HFCache(self, rows)
            self.sampler.start(cache.sampling, new, constraints, vocab_size(self.lm))
        elif not isinstance(cache, HFCache) or cache.owner is not self:
            raise ValueError(f"cache must be an HFCache made by this component, got {cache!r}")
        elif len(cache) != rows:
            raise ValueError(f"cache has {len(cache)} rows, input_ids {rows}")
        device = next(self.lm.parameters()).device
        start = cache.length
        kwargs: dict[str, Any] = {}
        if self._takes_positions:  # as generate() makes them for unpadded rows
            kwargs["position_ids"] = torch.arange(start, start + new, device=device).expand(
                rows, -1
            )
        kwargs[self._cache_arg] = cache.past
        out = self.lm(
            input_ids=input_ids.to(device),
            attention_mask=torch.ones(rows, start + new, dtype=torch.long, device=device),
            use_cache=True,
            **kwargs,
        )
        past = getattr(out, "cache", None)
        cache.past = past if past is not None else out.past_key_values
        logits = out.logits[:, -1]  # [B, V]
        for r in range(rows):
            cache.tokens[r].extend(int(t) for t in input_ids[r].tolist())
        args = {
            "step": step,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "repetition_penalty": repetition_penalty,
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "min_tokens": min_tokens,
            "logprobs": logprobs,
            "with_logprobs": with_logprobs,
        }
        token, *rest = self.sampler.sample_call(args, list(logits), cache.tokens, cache.sampling)
        return (token, cache, *rest)


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
