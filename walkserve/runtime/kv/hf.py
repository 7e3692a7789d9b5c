"""Unmodified Hugging Face causal LMs over the paged KV pool: ``PagedCausalLMRunner`` runs one
packed forward of many sequences and returns each sequence's last-token logits.

Owns the packing of a step (one row of tokens, explicit positions), the pool's shape for a model
(``pool_for``: one ``GroupedKVPool`` group per kind of attention layer, found by
``hf_attention.probe_attention``), and the step context that the registered attention function
(``hf_attention.py``) answers from: per layer group its backend and plan.

What crosses the boundary:

- in: ``SeqChunk`` per sequence (its new token ids, or its new input embeddings, how many
  tokens are already in the pool, and its ``SeqId``: the runner reads its block tables from the
  pool), and a model loaded with ``attn_implementation=ATTN_IMPLEMENTATION``;
- out: logits ``[num_seqs, vocab]``, one row per chunk (the logits after its last token), or,
  from ``last_hidden_states`` on a base model fed embeddings (image-token generation, whose
  head is not the LM head), the last token's hidden state ``[num_seqs, hidden]``.

The model is not modified. transformers computes q/k/v, positions (RoPE, learned absolute
positions) and any q/k norm itself and then calls the registered function, which writes the
step's K/V into the pool at the slots of ``module.layer_idx`` and attends over its group's pages
with the layer's own scale, soft cap, sinks and window. The pool is the cache: the model runs
with ``use_cache=False``. Packed input, one row::

    input_ids       [ a0 a1 a2 | b7 | c3 c4 ]          [1, total_tokens]
    position_ids    [ 0  1  2  | 7  | 3  4  ]          explicit per token (b, c: cached context)
    attention_mask  [ 1  1  1  | 1  | 1  1  ]          all ones: no padding, no packing remap
    last rows                2    3       5           logits kept for these rows only
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from walkserve.runtime.kv.attention import (
    AttentionConfig,
    AttentionMetadata,
    ScoreParams,
    SequenceSpec,
    write_kv,
)
from walkserve.runtime.kv.hf_attention import (
    ATTN_IMPLEMENTATION,
    ModelAttention,
    UnsupportedAttention,
    attention_context,
    probe_attention,
    register,
    text_config,
)
from walkserve.runtime.kv.layer_groups import GroupedKVPool, LayerGroup
from walkserve.runtime.kv.pool_types import SeqId
from walkserve.runtime.kv.torch_attention import TorchPagedAttention, TorchPlan

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PagedCausalLMRunner",
    "PagedStep",
    "SeqChunk",
    "UnsupportedAttention",
    "layer_groups",
    "pool_for",
    "register",
]


def layer_groups(attention: ModelAttention) -> list[LayerGroup]:
    """One group per distinct (heads, KV heads, K/V sizes, window), layers ascending."""
    kinds: dict[tuple[int, int, int, int, int | None], list[int]] = {}
    for a in attention.layers:
        key = (a.num_heads, a.kv_heads, a.head_dim, a.v_head_dim, a.window)
        kinds.setdefault(key, []).append(a.layer)
    return [
        LayerGroup(tuple(layers), heads, kv_heads, dk, dv, window)
        for (heads, kv_heads, dk, dv, window), layers in kinds.items()
    ]


def pool_for(
    model: nn.Module,
    num_pages: int,
    page_size: int,
    device: torch.device | str | None = None,
    attention: ModelAttention | None = None,
) -> GroupedKVPool:
    """A pool shaped for ``model``'s attention layers (probed when ``attention`` is not given),
    in its dtype: ``num_pages`` pages of ``page_size`` tokens per layer group."""
    attention = attention if attention is not None else probe_attention(model)
    param = next(model.parameters())
    return GroupedKVPool(
        layer_groups(attention),
        num_pages,
        page_size,
        dtype=param.dtype,
        device=param.device if device is None else device,
    )


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step: ``token_ids`` go at positions ``context_len ..``; the
    pool already holds positions ``[0, context_len)`` of ``seq`` and has room for the new ones.

    ``inputs_embeds`` (``[n, hidden]``), when given, are fed instead of token ids (then
    ``token_ids`` is empty): models that feed embeddings of another table, as Janus feeds its
    image-token embeddings."""

    token_ids: tuple[int, ...]
    context_len: int
    seq: SeqId
    inputs_embeds: torch.Tensor | None = field(default=None, compare=False)  # [n, hidden]

    def __post_init__(self) -> None:
        if self.inputs_embeds is not None and (self.token_ids or self.inputs_embeds.dim() != 2):
            raise ValueError(
                "a SeqChunk takes token_ids or inputs_embeds [n, hidden], not both; got "
                f"{len(self.token_ids)} ids and embeds of shape {tuple(self.inputs_embeds.shape)}"
            )

    @property
    def query_len(self) -> int:
        """New tokens of this chunk."""
        if self.inputs_embeds is not None:
            return int(self.inputs_embeds.shape[0])
        return len(self.token_ids)


@dataclass(frozen=True)
class PagedStep:
    """One forward's attention work: the pool, and per layer group its backend and plan."""

    pool: GroupedKVPool
    backends: tuple[TorchPagedAttention, ...]
    plans: tuple[AttentionMetadata[TorchPlan], ...]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, Dv]
        window: int | None,
        scores: ScoreParams,
    ) -> torch.Tensor:  # [T, H, Dv]
        where = self.pool.where.get(layer)
        if where is None:
            raise UnsupportedAttention(f"layer {layer} has no K/V in the pool (not probed)")
        group = where[0]
        backend = self.backends[group]
        if backend.config.sliding_window != window:
            raise UnsupportedAttention(
                f"layer {layer} attends with window {window}, but was probed with "
                f"{backend.config.sliding_window}"
            )
        k_cache, v_cache = self.pool.kv(layer)  # [P, S, KVH, D], [P, S, KVH, Dv]
        metadata = self.plans[group]
        write_kv(k_cache, v_cache, metadata.slot_mapping, k, v)
        return backend.run(q, k_cache, v_cache, metadata, scores)


class PagedCausalLMRunner:
    """Runs packed forwards of a transformers causal LM over ``pool`` (one model, one pool,
    shaped by ``pool_for``)."""

    def __init__(self, model: nn.Module, pool: GroupedKVPool) -> None:
        config = text_config(model)
        impl = getattr(config, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model uses attn_implementation={impl!r}; load it with "
                f"attn_implementation={register()!r} (after walkserve.runtime.kv.hf.register())"
            )
        self.model = model
        self.pool = pool
        self.device = pool.pools[0].k.device
        self.backends = tuple(
            TorchPagedAttention(
                AttentionConfig(
                    num_heads=g.num_heads,
                    num_kv_heads=g.kv_heads,
                    head_dim=g.head_dim,
                    page_size=pool.page_size,
                    sliding_window=g.window,
                    v_head_dim=g.v_head_dim,
                ),
                device=self.device,
            )
            for g in pool.groups
        )
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def plan(self, chunks: Sequence[SeqChunk]) -> PagedStep:
        """Every group's attention plan for ``chunks``, from the pool's block tables."""
        plans = []
        for group, backend in enumerate(self.backends):
            specs = []
            for c in chunks:
                table = self.pool.block_table(c.seq, group)
                specs.append(
                    SequenceSpec(table.pages, c.context_len, c.query_len, table.first_page)
                )
            plans.append(backend.plan(specs))
        return PagedStep(self.pool, self.backends, tuple(plans))

    @torch.no_grad()
    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:  # [num_chunks, vocab]
        """One forward over all chunks packed in one row; logits of each chunk's last token."""
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            positions.extend(range(c.context_len, c.context_len + len(c.token_ids)))
            last.append(len(ids) - 1)
        dev = self.device
        kwargs: dict[str, Any] = {}
        if self._keeps_logits:
            kwargs["logits_to_keep"] = torch.tensor(last, device=dev)
        with attention_context(self.plan(chunks)):
            out = self.model(
                input_ids=torch.tensor([ids], device=dev),  # [1, T]
                position_ids=torch.tensor([positions], device=dev),  # [1, T]
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                use_cache=False,
                **kwargs,
            )
        logits = out.logits[0]
        return logits if self._keeps_logits else logits[last]  # [num_chunks, vocab]

    @torch.no_grad()
    def last_hidden_states(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:  # [n, hidden]
        """One forward of a base model (``*Model``, no LM head) over chunks that carry
        ``inputs_embeds``, packed in one row; the final-norm hidden state of each chunk's last
        token, for heads other than the LM head."""
        if any(c.inputs_embeds is None for c in chunks):
            raise ValueError("last_hidden_states takes chunks with inputs_embeds only")
        embeds = [c.inputs_embeds for c in chunks if c.inputs_embeds is not None]
        positions: list[int] = []
        last: list[int] = []
        for c in chunks:
            positions.extend(range(c.context_len, c.context_len + c.query_len))
            last.append(len(positions) - 1)
        dev = self.device
        with attention_context(self.plan(chunks)):
            out = self.model(
                inputs_embeds=torch.cat(embeds).to(dev).unsqueeze(0),  # [1, T, hidden]
                position_ids=torch.tensor([positions], device=dev),  # [1, T]
                attention_mask=torch.ones(1, len(positions), dtype=torch.long, device=dev),
                use_cache=False,
            )
        return out.last_hidden_state[0, last]  # [num_chunks, hidden]
