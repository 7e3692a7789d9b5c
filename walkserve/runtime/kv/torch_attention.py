"""``TorchPagedAttention``: paged attention in plain PyTorch, the reference backend of
``attention.py``'s contract. Runs on CPU and CUDA; the twin that accelerated backends (FlashInfer)
are tested against, and the one the model runner uses.

Owns the gather of each sequence's live pages into contiguous K/V, the masks (causal, sliding
window, offset by the pages a window freed) and the score math: ``scaled_dot_product_attention``
when scores are plain (scale only), an explicit softmax when a layer soft-caps its logits or has
attention sinks (``attend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from walkserve.runtime.kv.attention import (
    AttentionConfig,
    AttentionMetadata,
    ScoreParams,
    SequenceSpec,
    check_run_inputs,
    host_layout,
    live_pages,
    pages_needed,
)

SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""``scaled_dot_product_attention(..., enable_gqa=True)`` exists (torch >= 2.5)."""


@dataclass(frozen=True, eq=False)
class DecodeGroup:
    """All single-query sequences, attended in one padded call."""

    rows: torch.Tensor  # [n] int64: their rows of q
    pages: torch.Tensor  # [n, max_pages] int64, padded with the sequence's first live page
    mask: torch.Tensor  # [n, 1, 1, max_pages * page_size] bool, True = attend


@dataclass(frozen=True, eq=False)
class PrefillPiece:
    """One multi-query sequence (prefill or chunked prefill), attended on its own."""

    q_start: int
    q_end: int
    pages: torch.Tensor  # [live pages] int64
    key_len: int  # keys gathered: seq_len - first_page * page_size
    mask: torch.Tensor  # [query_len, key_len] bool, True = attend


@dataclass(frozen=True, eq=False)
class TorchPlan:
    decode: DecodeGroup | None
    prefills: tuple[PrefillPiece, ...]


def attend_mask(
    context_len: int, query_len: int, window: int | None, key_start: int = 0
) -> torch.Tensor:
    """``[query_len, seq_len - key_start]`` bool: query at ``p = context_len + i`` sees key
    ``j`` (column ``j - key_start``) iff ``j <= p`` and (no window or ``j > p - window``)."""
    p = torch.arange(context_len, context_len + query_len).unsqueeze(1)  # [L, 1]
    j = torch.arange(key_start, context_len + query_len).unsqueeze(0)  # [1, S]
    mask = j <= p
    if window is not None:
        mask &= j > p - window
    return mask


def attend(
    q: torch.Tensor,  # [N, H, L, D]
    k: torch.Tensor,  # [N, KVH, S, D]
    v: torch.Tensor,  # [N, KVH, S, Dv]
    mask: torch.Tensor,  # broadcastable to [N, 1, L, S], True = attend
    scores: ScoreParams,
) -> torch.Tensor:  # [N, H, L, Dv]
    """Attention with transformers' score order (see ``attention.py``). Plain scores go to
    ``scaled_dot_product_attention``; a soft cap or sinks take the explicit path, softmax in
    float32 as transformers' eager attention does."""
    n, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if scores.softcap is None and scores.sinks is None:
        if group == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scores.scale)
        if length == 1:
            # Decode: the `group` query heads of a KV head become `group` query rows of it (a
            # view, no K/V copies; head h reads KV head h // group, as transformers' repeat_kv
            # orders them). Much faster on CPU than enable_gqa with a mask.
            qg = q.reshape(n, kv_heads, group, dim)  # [N, KVH, group, D]
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scores.scale)
            return out.reshape(n, heads, 1, v.shape[-1])
        if SDPA_HAS_GQA:  # query head h reads KV head h // group inside the kernel
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scores.scale, enable_gqa=True
            )
        k = k.repeat_interleave(group, dim=1)  # [N, H, S, D]
        v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scores.scale)
    if mask.dim() == 2:
        mask = mask[None, None]  # [1, 1, L, S]
    qg = q.reshape(n, kv_heads, group, length, dim)  # [N, KVH, g, L, D]
    logits = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scores.scale  # [N,KVH,g,L,S]
    if scores.softcap is not None:
        logits = torch.tanh(logits / scores.softcap) * scores.softcap
    logits = logits.float().masked_fill(~mask.unsqueeze(2), float("-inf"))
    if scores.sinks is not None:
        sink = scores.sinks.float().reshape(1, kv_heads, group, 1, 1).expand(n, -1, -1, length, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v.unsqueeze(2))  # [N, KVH, g, L, Dv]
    return out.reshape(n, heads, length, v.shape[-1])


class TorchPagedAttention:
    """Paged attention in plain PyTorch: gathers each sequence's live pages into contiguous K/V
    and attends with an explicit mask (``attend``).

    Plan: single-query sequences (decode) form one group, padded to the group's longest
    sequence (in whole pages) and masked; every multi-query sequence is one piece with its own
    causal/window mask. K/V are gathered by whole pages (one contiguous block per page, several
    times faster on CPU than gathering token slots; the slots past a sequence's end that this
    reads are masked, and hold zeros or the sequence's own stale values, never another
    request's: ``KVPool`` zeroes every page it hands out). Key column ``j`` of a sequence is
    position ``first_page * page_size + j``. All gather indices and masks are built in ``plan``;
    ``run`` only gathers and attends. Stateless between steps, so any number of plans may be
    live at once.
    """

    def __init__(self, config: AttentionConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)

    def plan(self, batch: Sequence[SequenceSpec], slot: int = 0) -> AttentionMetadata[TorchPlan]:
        layout = host_layout(batch, self.config)
        window, page_size, dev = self.config.sliding_window, self.config.page_size, self.device
        starts = layout.query_start.tolist()
        decode_ids = [i for i, s in enumerate(batch) if s.query_len == 1]
        decode: DecodeGroup | None = None
        if decode_ids:
            own = {i: live_pages(batch[i], page_size) for i in decode_ids}
            max_pages = max(len(p) for p in own.values())
            pages = torch.empty(len(decode_ids), max_pages, dtype=torch.int64)
            mask = torch.zeros(len(decode_ids), 1, 1, max_pages * page_size, dtype=torch.bool)
            for row, i in enumerate(decode_ids):
                spec = batch[i]
                pages[row] = own[i][0]  # padding reads a valid page; the mask hides it
                pages[row, : len(own[i])] = torch.tensor(own[i], dtype=torch.int64)
                start = spec.first_page * page_size
                keys = attend_mask(spec.context_len, 1, window, start)[0]
                mask[row, 0, 0, : keys.shape[0]] = keys
            decode = DecodeGroup(
                rows=torch.tensor([starts[i] for i in decode_ids], device=dev),
                pages=pages.to(dev),
                mask=mask.to(dev),
            )
        prefills = tuple(
            PrefillPiece(
                q_start=starts[i],
                q_end=starts[i + 1],
                pages=torch.tensor(live_pages(s, page_size), dtype=torch.int64).to(dev),
                key_len=s.seq_len - s.first_page * page_size,
                mask=attend_mask(s.context_len, s.query_len, window, s.first_page * page_size).to(
                    dev
                ),
            )
            for i, s in enumerate(batch)
            if s.query_len > 1
        )
        return layout.to_metadata(self.config, slot, dev, TorchPlan(decode, prefills))

    def run(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [P, S, KVH, D]
        v_cache: torch.Tensor,  # [P, S, KVH, Dv]
        metadata: AttentionMetadata[TorchPlan],
        scores: ScoreParams | None = None,
    ) -> torch.Tensor:  # [T, H, Dv]
        check_run_inputs(q, k_cache, v_cache, metadata, scores)
        params = scores if scores is not None else ScoreParams.of(self.config)
        plan = metadata.prepared
        kv_heads, dk, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
        out = q.new_empty(q.shape[0], q.shape[1], dv)  # [T, H, Dv]
        if plan.decode is not None:
            d = plan.decode
            n = d.pages.shape[0]
            qd = q[d.rows].unsqueeze(2)  # [n, H, 1, D]
            index = d.pages.view(-1)
            kd = k_cache.index_select(0, index).view(n, -1, kv_heads, dk)  # [n, pages * S, ..]
            vd = v_cache.index_select(0, index).view(n, -1, kv_heads, dv)
            o = attend(qd, kd.transpose(1, 2), vd.transpose(1, 2), d.mask, params)
            out[d.rows] = o.squeeze(2)
        for piece in plan.prefills:
            qp = q[piece.q_start : piece.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            kp = k_cache.index_select(0, piece.pages).view(1, -1, kv_heads, dk)[:, : piece.key_len]
            vp = v_cache.index_select(0, piece.pages).view(1, -1, kv_heads, dv)[:, : piece.key_len]
            o = attend(qp, kp.transpose(1, 2), vp.transpose(1, 2), piece.mask, params)
            out[piece.q_start : piece.q_end] = o[0].transpose(0, 1)
        return out


__all__ = [
    "SDPA_HAS_GQA",
    "DecodeGroup",
    "PrefillPiece",
    "TorchPagedAttention",
    "TorchPlan",
    "attend",
    "attend_mask",
    "pages_needed",
]
