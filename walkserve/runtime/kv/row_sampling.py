"""The text engines' per-request sampling (``PagedLM`` and ``HFCacheLM`` share it): what a
request's rows keep between calls, and one call's tokens (and logprobs) from its rows' logits.

What crosses the boundary:

- ``TextSampler(stop_ids, vocabulary)``: one per engine instance; ``stop_ids`` are the walks'
  EOS (``min_tokens`` holds them back), ``vocabulary`` the tokenizer's bytes for grammars
  (``grammar.Vocabulary``; None: a request with a grammar fails);
- ``RowState``: one row of a request, made by ``start`` when the request's cache is made (the
  call with ``cache`` None): its prompt length (which tokens are generated), its logit bias and
  its grammar ``Guide`` (``constraints``, ``grammar.Constraints`` in a uint8 tensor);
- ``sample_call(args, logits, seen, states)``: the call's outputs, ``(token [B, 1],)`` or, with
  ``with_logprobs``, ``(token, logprobs [B, 1, n], logprob_ids [B, 1, n])`` where ``n`` is the
  call's ``logprobs``. Each row's token is ``sampling.seeded_token``'s rule: the draw depends on
  the request's own inputs only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.runtime.kv import grammar
from walkserve.runtime.kv.sampling import seeded_token, token_logprobs


@dataclass
class RowState:
    prompt: int = 0  # leading tokens that are the prompt (the rest were generated)
    guide: grammar.Guide | None = None  # a structured-output request's grammar state
    bias: tuple[tuple[int, float], ...] = ()  # logit_bias


class TextSampler:
    def __init__(self, stop_ids: Sequence[int] = (), vocabulary: grammar.Vocabulary | None = None):
        self.stop_ids = tuple(int(t) for t in stop_ids)
        self.vocabulary = vocabulary
        self._grammars: grammar.GrammarCache | None = None

    def start(self, rows: Sequence[RowState], prompt: int, constraints: Any, n_vocab: int) -> None:
        """A new request's rows: its prompt length and its constraints (every row the same)."""
        wanted = grammar.decode(constraints)
        if any(not 0 <= t < n_vocab for t, _ in wanted.logit_bias):
            raise ValueError(f"logit_bias ids must be in [0, {n_vocab})")
        for r in rows:
            r.prompt = prompt
            r.bias = tuple(wanted.logit_bias)
            if wanted.grammar is not None:
                if self.vocabulary is None:
                    raise ValueError("this model has no vocabulary for grammars")
                if self._grammars is None:
                    self._grammars = grammar.GrammarCache(self.vocabulary)
                r.guide = self._grammars.guide(wanted.grammar, n_vocab)

    def sample_call(
        self,
        args: Mapping[str, Any],
        logits: Sequence[torch.Tensor],  # per row: [V]
        seen: Sequence[Sequence[int]],  # per row: every token fed so far, prompt included
        states: Sequence[RowState],
    ) -> tuple[torch.Tensor, ...]:
        step = args.get("step", 0)
        n = int(args.get("logprobs", 0))
        tokens, values, ids = [], [], []
        for row, (row_logits, row_seen, state) in enumerate(zip(logits, seen, states)):
            count = int(step[row].reshape(-1)[0]) if isinstance(step, torch.Tensor) else int(step)
            token = seeded_token(
                row_logits,
                row,
                count,
                temperature=float(args.get("temperature", 0.0)),
                top_p=float(args.get("top_p", 1.0)),
                top_k=int(args.get("top_k", 0)),
                seed=int(args.get("seed", 0)),
                repetition_penalty=float(args.get("repetition_penalty", 1.0)),
                seen=row_seen,
                presence_penalty=float(args.get("presence_penalty", 0.0)),
                frequency_penalty=float(args.get("frequency_penalty", 0.0)),
                min_tokens=int(args.get("min_tokens", 0)),
                stop_ids=self.stop_ids,
                generated=row_seen[state.prompt :],
                logit_bias=state.bias,
                allowed=None if state.guide is None else state.guide.allowed(),
            )
            if state.guide is not None:
                state.guide.advance(token)
            tokens.append(token)
            if args.get("with_logprobs"):
                v, t = token_logprobs(row_logits, token, n)
                values.append(v)
                ids.append(t)
        token_out = torch.tensor(tokens, dtype=torch.int64).unsqueeze(1)  # [B, 1]
        if not args.get("with_logprobs"):
            return (token_out,)
        return token_out, torch.stack(values)[:, None], torch.stack(ids)[:, None]


def vocab_size(lm: Any) -> int:
    """The width of ``lm``'s logits."""
    return int(lm.get_output_embeddings().weight.shape[0])
