"""The text engine of a Hugging Face causal LM, chosen at load time, and the start-up self-check.

``text_engine(lm)``: the paged engine (``PagedLM``) when every attention layer of the model goes
through transformers' attention interface with what the paged pool can compute exactly (probed:
``hf_attention.probe_attention``); else the fallback ``HFCacheLM`` (the model's own forward and
cache per request: exact, slower), with the reason. Both carry an ``EngineChoice``.

``self_check(paged)``: one short probe through the paged forward against the model's own eager
forward, before a server starts: two prompts packed in one prefill, then packed decode steps
(context in the pool, explicit positions), on pages of 4 tokens. Logits beyond the tolerance raise
``SelfCheckFailed`` naming the first layer whose hidden states differ and by how much.
``check_engines(model)`` runs it for every ``PagedLM`` inside a model and reports every engine.

    prompts   a: 11 tokens   b: 6 tokens
    step 1    a[0:8] | b[0:4]         one packed prefill (hidden states of every layer compared)
    step 2    a[8]   | b[4]           packed decode
    step 3    a[9]   | b[5]
    step 4    a[10]                   logits of every row compared with eager over a and b
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from walkserve.runtime.kv.engine_report import EngineChoice, engine_choices
from walkserve.runtime.kv.grammar import Vocabulary
from walkserve.runtime.kv.hf import PagedCausalLMRunner, SeqChunk, pool_for
from walkserve.runtime.kv.hf_attention import (
    UnsupportedAttention,
    attention_context,
    probe_attention,
    text_config,
    use_paged_attention,
)
from walkserve.runtime.kv.hf_cache_lm import HFCacheLM
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig
from walkserve.runtime.kv.pool_types import SeqId

__all__ = ["SelfCheck", "SelfCheckFailed", "check_engines", "self_check", "text_engine"]

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
"""Relative tolerance of the self-check by dtype (``max |diff| <= tol * max(1, max |eager|)``);
half precision: ``HALF_TOLERANCE``."""
HALF_TOLERANCE = 3e-2
PROMPTS = (11, 6)
PREFILL = (8, 4)
CHECK_PAGE = 4


class SelfCheckFailed(RuntimeError):
    """The paged forward of a model differs from its eager forward beyond the tolerance."""


def text_engine(
    lm: nn.Module,
    kv: PagedLMConfig | None = None,
    stop_ids: Sequence[int] = (),
    vocabulary: Vocabulary | None = None,
) -> PagedLM | HFCacheLM:
    """The engine that serves ``lm`` exactly: ``PagedLM`` if it can, else ``HFCacheLM``;
    ``stop_ids`` and ``vocabulary`` go to its sampler (``row_sampling.TextSampler``)."""
    config = text_config(lm)
    original = getattr(config, "_attn_implementation", None)
    try:
        use_paged_attention(lm)
        attention = probe_attention(lm)
    except UnsupportedAttention as e:
        if original is not None and getattr(config, "_attn_implementation", None) != original:
            lm.set_attn_implementation(original)  # type: ignore[operator]
        return HFCacheLM(lm, reason=str(e), stop_ids=stop_ids, vocabulary=vocabulary)
    return PagedLM(lm, kv, attention=attention, stop_ids=stop_ids, vocabulary=vocabulary)


@dataclass(frozen=True)
class SelfCheck:
    max_logit_diff: float
    tolerance: float  # absolute, for the logits
    seconds: float

    def describe(self) -> str:
        return (
            f"passed in {self.seconds:.2f} s: logits within {self.max_logit_diff:.2g} of eager, "
            f"tolerance {self.tolerance:.2g}"
        )


def _tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


@torch.no_grad()
def self_check(paged: PagedLM) -> SelfCheck:
    """Check ``paged`` (see the module docstring); raises ``SelfCheckFailed``."""
    t0 = time.perf_counter()
    lm = paged.lm
    config = text_config(lm)
    vocab = int(config.vocab_size)
    prompts = [[(i * 13 + 7 * s + 3) % vocab for i in range(n)] for s, n in enumerate(PROMPTS)]
    dtype = next(lm.parameters()).dtype
    rel = _tolerance(dtype)
    want_logits, want_hidden = _eager(lm, prompts)
    pool = pool_for(lm, num_pages=2 * (-(-max(PROMPTS) // CHECK_PAGE)) + 2, page_size=CHECK_PAGE)
    runner = PagedCausalLMRunner(lm, pool)
    seqs = [SeqId(f"self-check-{i}", "text") for i in range(len(prompts))]
    steps = [list(zip(range(len(prompts)), PREFILL))]
    for k in range(max(n - p for n, p in zip(PROMPTS, PREFILL))):
        steps.append(
            [(i, PREFILL[i] + k + 1) for i in range(len(prompts)) if PREFILL[i] + k < PROMPTS[i]]
        )
    done = [0] * len(prompts)
    worst, scale = 0.0, 1.0
    for index, step in enumerate(steps):
        chunks = []
        for i, end in step:
            if done[i] == 0:
                pool.allocate(seqs[i], end)
            else:
                pool.append(seqs[i], end - done[i])
            chunks.append(SeqChunk(tuple(prompts[i][done[i] : end]), done[i], seqs[i]))
        logits, hidden = _paged(runner, chunks)
        row = 0
        for (i, end), chunk in zip(step, chunks):
            rows = slice(row, row + chunk.query_len)
            got, want = logits[rows], want_logits[i][done[i] : end]
            scale = max(scale, float(want.abs().max()))
            diff = float((got - want).abs().max())
            worst = max(worst, diff)
            if diff > rel * max(1.0, float(want.abs().max())):
                layer = _first_bad_layer(hidden, want_hidden[i], rows, done[i], end, rel)
                raise SelfCheckFailed(
                    f"{type(lm).__name__}: the paged forward differs from the model's eager "
                    f"forward at step {index + 1} of the start-up check: logits by {diff:.3g} "
                    f"(tolerance {rel * max(1.0, float(want.abs().max())):.3g}); {layer}"
                )
            row += chunk.query_len
        for i, end in step:
            done[i] = end
            pool.mark_computed(seqs[i], end)
    for seq in seqs:
        pool.free(seq)
    return SelfCheck(worst, rel * scale, time.perf_counter() - t0)


def _eager(lm: nn.Module, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[Any]]:
    """Logits [n, V] and hidden states of every prompt from the model's own eager forward (its
    own cache, as ``generate()`` prefills), with the attention switched back afterwards."""
    config = text_config(lm)
    impl = config._attn_implementation
    lm.set_attn_implementation("eager")  # type: ignore[operator]
    try:
        logits, hidden = [], []
        device = next(lm.parameters()).device
        for prompt in prompts:
            out = lm(
                input_ids=torch.tensor([prompt], device=device),
                use_cache=True,
                output_hidden_states=True,
            )
            logits.append(out.logits[0].float())
            hidden.append(out.hidden_states)
        return logits, hidden
    finally:
        lm.set_attn_implementation(impl)  # type: ignore[operator]


def _paged(runner: PagedCausalLMRunner, chunks: list[SeqChunk]) -> tuple[torch.Tensor, Any]:
    ids = [t for c in chunks for t in c.token_ids]
    positions = [p for c in chunks for p in range(c.context_len, c.context_len + c.query_len)]
    dev = runner.device
    with attention_context(runner.plan(chunks)):
        out = runner.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([positions], device=dev),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
            use_cache=False,
            output_hidden_states=True,
        )
    return out.logits[0].float(), out.hidden_states


def _first_bad_layer(hidden: Any, want: Any, rows: slice, start: int, end: int, rel: float) -> str:
    """Which decoder layer's output first differs beyond the tolerance (``hidden_states[0]`` is
    the embeddings, ``[i + 1]`` layer i's output)."""
    if hidden is None or want is None:
        return "the model returns no hidden states to locate the layer"
    for i, (got, ref) in enumerate(zip(hidden, want)):
        g, w = got[0, rows].float(), ref[0, start:end].float()
        diff = float((g - w).abs().max())
        if diff > rel * max(1.0, float(w.abs().max())):
            where = "the embeddings" if i == 0 else f"layer {i - 1}"
            return f"first at {where} (hidden states differ by {diff:.3g})"
    return "no layer's hidden states differ beyond the tolerance (the head does)"


def check_engines(model: nn.Module) -> dict[str, EngineChoice]:
    """Self-check every ``PagedLM`` in ``model`` (raises ``SelfCheckFailed``), record the result
    in its ``engine_choice``; every text engine's choice by module path."""
    for module in model.modules():
        if isinstance(module, PagedLM):
            result = self_check(module)
            module.engine_choice = replace(module.engine_choice, self_check=result.describe())
    return engine_choices(model)
