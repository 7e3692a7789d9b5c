"""Unmodified Hugging Face causal LMs over the paged KV pool.

Owns the bridge between transformers' attention-function registry and the pool: an attention
function registered under ``ATTN_IMPLEMENTATION`` ("walkserve_paged"), the scoped context that
gives it one step's pool and ``AttentionMetadata``, and ``PagedCausalLMRunner``, which runs one
packed forward of many sequences and returns each sequence's last-token logits.

What crosses the boundary:

- in: ``SeqChunk`` per sequence (its new token ids, or its new input embeddings, how many
  tokens are already in the pool, its block table), and a model loaded with
  ``attn_implementation=ATTN_IMPLEMENTATION``;
- out: logits ``[num_seqs, vocab]``, one row per chunk (the logits after its last token), or,
  from ``last_hidden_states`` on a base model fed embeddings (image-token generation, whose
  head is not the LM head), the last token's hidden state ``[num_seqs, hidden]``.

The model is not modified. transformers computes q/k/v, RoPE and any q/k norm itself (Qwen3's
``q_norm``/``k_norm``) and then calls the registered function, which writes the step's K/V into
the pool at ``metadata.slot_mapping`` for ``module.layer_idx`` and attends over the pages. The
pool is the cache: the model runs with ``use_cache=False``. Packed input, one row::

    input_ids     [ a0 a1 a2 | b7 | c3 c4 ]          [1, total_tokens]
    position_ids  [ 0  1  2  | 7  | 3  4  ]          explicit per token (b, c: cached context)
    last rows                2    3       5          logits kept for these rows only

transformers builds no attention mask for an implementation it does not know, so no
``[T, T]`` mask is made; the masks live in the attention plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from walkserve.runtime.kv.attention import (
    AttentionConfig,
    AttentionMetadata,
    SequenceSpec,
    TorchPagedAttention,
    TorchPlan,
    write_kv,
)
from walkserve.runtime.kv.pool import KVPool, KVPoolConfig

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PagedCausalLMRunner",
    "PagedStep",
    "SeqChunk",
    "attention_heads",
    "paged_attention_forward",
    "paged_step",
    "pool_config_for",
    "pool_for",
    "register",
]

ATTN_IMPLEMENTATION = "walkserve_paged"


@dataclass(frozen=True)
class PagedStep:
    """What the attention function needs during one forward: the pool, the backend, the plan."""

    pool: KVPool
    backend: TorchPagedAttention
    metadata: AttentionMetadata[TorchPlan]


_STEP: ContextVar[PagedStep | None] = ContextVar("walkserve_paged_step", default=None)


@contextmanager
def paged_step(step: PagedStep) -> Iterator[PagedStep]:
    """Make ``step`` visible to the registered attention function for the enclosed forward."""
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D], RoPE (and q norm) applied
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, D], no weights)
    """The function registered in transformers' ``AttentionInterface``."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside "
            "walkserve.runtime.kv.hf.paged_step(...): use PagedCausalLMRunner"
        )
    if query.shape[0] != 1:
        raise ValueError(f"paged attention takes one packed row, got batch {query.shape[0]}")
    layer = int(getattr(module, "layer_idx"))  # noqa: B009 - set by every HF attention module
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, KVH, D]
    v = value[0].transpose(0, 1)
    k_cache, v_cache = step.pool.k[layer], step.pool.v[layer]  # [P, S, KVH, D]
    write_kv(k_cache, v_cache, step.metadata.slot_mapping, k, v)
    out = step.backend.run(q.contiguous(), k_cache, v_cache, step.metadata)  # [T, H, D]
    return out.unsqueeze(0), None


def register() -> str:
    """Register ``paged_attention_forward`` with transformers (idempotent); returns its name,
    for ``from_pretrained(..., attn_implementation=...)``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def _text_config(model: nn.Module) -> Any:
    config: Any = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def attention_heads(model: nn.Module, tensor_parallel: int | None = None) -> tuple[int, int]:
    """Query and KV heads of one rank's shard of ``model`` at ``tensor_parallel`` (default: the
    model's own degree, transformers' ``model.tp_size``): the config's, split as
    ``runtime.tp.heads`` splits them; the pool then holds only this rank's KV heads."""
    config = _text_config(model)
    heads = int(config.num_attention_heads)
    kv = int(config.num_key_value_heads or heads)
    tp = tensor_parallel or int(getattr(model, "tp_size", None) or 1)
    if tp == 1:
        return heads, kv
    from walkserve.runtime.tp.heads import split_heads

    split = split_heads(heads, kv, tp)
    return split.heads, split.kv_heads


def pool_config_for(
    model: nn.Module,
    num_pages: int,
    page_size: int,
    device: torch.device | str | None = None,
    tensor_parallel: int | None = None,
) -> KVPoolConfig:
    """The shape of a pool for ``model``'s layers, (this rank's) KV heads and head size, in
    its dtype: what ``pool_for`` allocates, or what a memory estimate counts."""
    config = _text_config(model)
    param = next(model.parameters())
    return KVPoolConfig(
        num_pages=num_pages,
        page_size=page_size,
        num_layers=int(config.num_hidden_layers),
        kv_heads=attention_heads(model, tensor_parallel)[1],
        head_dim=head_dim(config),
        dtype=param.dtype,
        device=torch.device(param.device if device is None else device),
    )


def pool_for(
    model: nn.Module, num_pages: int, page_size: int, device: torch.device | str | None = None
) -> KVPool:
    """A pool shaped for ``model`` (``pool_config_for``)."""
    c = pool_config_for(model, num_pages, page_size, device)
    return KVPool(c.num_pages, c.page_size, c.num_layers, c.kv_heads, c.head_dim, c.dtype, c.device)


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step: ``token_ids`` go at positions ``context_len ..``; the
    pool already holds positions ``[0, context_len)`` and has room for the new ones.

    ``inputs_embeds`` (``[n, hidden]``), when given, are fed instead of token ids (then
    ``token_ids`` is empty): models that feed embeddings of another table, as Janus feeds its
    image-token embeddings."""

    token_ids: tuple[int, ...]
    context_len: int
    block_table: tuple[int, ...]
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


class PagedCausalLMRunner:
    """Runs packed forwards of a transformers causal LM over ``pool`` (one model, one pool)."""

    def __init__(self, model: nn.Module, pool: KVPool) -> None:
        config = _text_config(model)
        impl = getattr(config, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model uses attn_implementation={impl!r}; load it with "
                f"attn_implementation={register()!r} (after walkserve.runtime.kv.hf.register())"
            )
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window layers are not supported by this runner yet")
        self.model = model
        self.pool = pool
        dim = head_dim(config)
        heads, kv_heads = attention_heads(model)
        self.backend = TorchPagedAttention(
            AttentionConfig(
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=dim,
                page_size=pool.page_size,
                scale=dim**-0.5,
            ),
            device=pool.k.device,
        )
        self.device = pool.k.device

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
        specs = [SequenceSpec(c.block_table, c.context_len, len(c.token_ids)) for c in chunks]
        step = PagedStep(self.pool, self.backend, self.backend.plan(specs))
        dev = self.device
        with paged_step(step):
            out = self.model(
                input_ids=torch.tensor([ids], device=dev),  # [1, T]
                position_ids=torch.tensor([positions], device=dev),  # [1, T]
                use_cache=False,
                logits_to_keep=torch.tensor(last, device=dev),
            )
        return out.logits[0]  # [num_chunks, vocab]

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
        specs = [SequenceSpec(c.block_table, c.context_len, c.query_len) for c in chunks]
        step = PagedStep(self.pool, self.backend, self.backend.plan(specs))
        dev = self.device
        with paged_step(step):
            out = self.model(
                inputs_embeds=torch.cat(embeds).to(dev).unsqueeze(0),  # [1, T, hidden]
                position_ids=torch.tensor([positions], device=dev),  # [1, T]
                use_cache=False,
            )
        return out.last_hidden_state[0, last]  # [num_chunks, hidden]
