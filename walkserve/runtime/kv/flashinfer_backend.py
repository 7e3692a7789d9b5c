"""FlashInfer paged attention on CUDA, behind the ``AttentionBackend`` interface of
``attention.py``, whose ``torch_attention.TorchPagedAttention`` is its CPU twin and test oracle.

Owns the translation from a batch's ``HostLayout`` to FlashInfer's CSR page table and the two
sets of planned wrappers. ``flashinfer`` is imported lazily, only when a backend is built on a
CUDA device; anything else raises ``FlashInferUnavailable`` with the reason.

Page table, NHD layout (``k_cache``/``v_cache``: ``[num_pages, page_size, kv_heads, head_dim]``,
exactly the pool's), page_size = 4::

    sequence       a (7 tokens)   b (5 tokens)   c (1 token)
    block table    [3, 1]         [2, 4]         [0]

    paged_kv_indices        [3, 1, 2, 4, 0]      pages of all sequences, back to back
    paged_kv_indptr         [0,    2,    4, 5]   sequence i's pages: indices[indptr[i]:indptr[i+1]]
    paged_kv_last_page_len  [3, 1, 1]            kv_len - (num_pages - 1) * page_size, in 1..4
    qo_indptr               = query_start        queries of sequence i: q[qo_indptr[i]:...[i+1]]

A sequence whose leading pages a sliding window freed lists only its live pages: its ``kv_len``
is ``seq_len - first_page * page_size``. FlashInfer sees positions relative to the first live
key, which changes nothing: RoPE is already in K, and the window and causal mask are relative.

``causal=True`` aligns the diagonal bottom-right (query i of a sequence with ``kv_len`` tokens
sees keys ``j <= i + kv_len - query_len``), which is the module contract of ``attention.py``.
FlashInfer's ``window_left`` counts keys left of the query itself, so a window ``W`` (query at p
sees ``(p - W, p]``) is ``window_left = W - 1``; no window is ``-1``.

Scores: FlashInfer fixes the softmax scale and the logit soft cap when it plans, so one backend
serves the layers of one ``AttentionConfig`` (``scale``, ``softcap``); a call whose
``ScoreParams`` differ is refused (build a backend per kind). Sinks are per call
(``run(..., sinks=)``, float32). Key and value head sizes may differ only in the prefill wrapper
(``head_dim_vo``), so such configs plan decode batches with it too.

UNVERIFIED: the soft cap, sinks, ``head_dim_vo`` and freed leading pages were written against
FlashInfer 0.7.2's signatures without a GPU (``tests/gpu/test_flashinfer_backend.py`` checks them
against the Torch twin where one is present); the window, GQA and plan/run pipeline were measured
on an H200 with FlashInfer 0.7.4.

Plan/run split and double buffering: ``plan(batch, slot)`` plans slot ``slot``'s wrapper (a
``BatchDecodeWithPagedKVCacheWrapper`` when every sequence has one query, else a
``BatchPrefillWithPagedKVCacheWrapper``) on a side CUDA stream and records an event;
``run`` makes the current stream wait for that event, runs, and records a "released" event.
Planning into a slot first waits on the host for that slot's released event, so a plan for step
N+2 never rewrites the wrapper buffers that step N's kernels may still read on the GPU, while a
plan for step N+1 (the other slot) runs freely alongside step N. Each slot has its own
workspace. Metadata whose slot was planned again is stale: ``run`` refuses it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from walkserve.runtime.kv.attention import (
    NUM_PLAN_SLOTS,
    AttentionConfig,
    AttentionMetadata,
    HostLayout,
    ScoreParams,
    SequenceSpec,
    check_run_inputs,
    host_layout,
)

MiB = 1 << 20
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


class FlashInferUnavailable(RuntimeError):
    """FlashInfer cannot run here (no CUDA device, or the package is not installed)."""


def import_flashinfer(device: torch.device) -> ModuleType:
    """Import ``flashinfer`` for ``device``, or raise ``FlashInferUnavailable`` saying why."""
    if device.type != "cuda":
        raise FlashInferUnavailable(
            f"FlashInfer runs only on CUDA devices, not {device}; use TorchPagedAttention"
        )
    if not torch.cuda.is_available():
        raise FlashInferUnavailable("FlashInfer needs CUDA, and torch sees no CUDA device")
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise FlashInferUnavailable(
            f"the 'flashinfer' package is not importable ({e}); install the gpu extra: "
            "pip install 'walkserve[gpu]'"
        ) from e


@dataclass(frozen=True)
class FlashInferPlan:
    """What ``run`` needs from ``plan``: which slot, which wrapper, and which generation of
    that slot's plan (so stale metadata is caught)."""

    slot: int
    generation: int
    kind: Literal["decode", "prefill"]


class _Slot:
    """One buffer: a decode and a prefill wrapper sharing one workspace (a step uses one)."""

    def __init__(self, flashinfer: ModuleType, device: torch.device, workspace_bytes: int):
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=True
        )
        self.prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.planned = torch.cuda.Event()
        self.released = torch.cuda.Event()
        self.generation = 0
        self.ever_run = False


class FlashInferPagedAttention:
    """Paged attention with FlashInfer's batch decode/prefill wrappers over the pool's NHD pages.

    ``dtype`` is the dtype of q and the caches (float16 or bfloat16); it is fixed because
    FlashInfer plans per dtype. ``workspace_bytes`` is per slot.
    """

    def __init__(
        self,
        config: AttentionConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        workspace_bytes: int = 128 * MiB,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"FlashInferPagedAttention supports {SUPPORTED_DTYPES}, not {dtype}")
        self.dtype = dtype
        flashinfer = import_flashinfer(self.device)
        with torch.cuda.device(self.device):
            self._slots = [
                _Slot(flashinfer, self.device, workspace_bytes) for _ in range(NUM_PLAN_SLOTS)
            ]
            self._plan_stream = torch.cuda.Stream(self.device)

    @property
    def window_left(self) -> int:
        window = self.config.sliding_window
        return -1 if window is None else window - 1

    def plan(
        self, batch: Sequence[SequenceSpec], slot: int = 0
    ) -> AttentionMetadata[FlashInferPlan]:
        layout = host_layout(batch, self.config)
        s = self._slots[slot]
        if s.ever_run:
            s.released.synchronize()  # the last step that read this slot is done on the GPU
        decode_ok = self.config.value_dim == self.config.head_dim  # no head_dim_vo in decode
        kind: Literal["decode", "prefill"] = (
            "decode" if decode_ok and all(spec.query_len == 1 for spec in batch) else "prefill"
        )
        with torch.cuda.device(self.device), torch.cuda.stream(self._plan_stream):
            self._plan_wrapper(s, kind, layout)
            s.planned.record(self._plan_stream)
        s.generation += 1
        prepared = FlashInferPlan(slot=slot, generation=s.generation, kind=kind)
        return layout.to_metadata(self.config, slot, self.device, prepared)

    def _plan_wrapper(self, s: _Slot, kind: str, layout: HostLayout) -> None:
        c, n = self.config, layout.num_pages
        indptr = torch.zeros(n.shape[0] + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(n, 0)
        indices = torch.cat(
            [row[:count] for row, count in zip(layout.block_tables, n.tolist())]
        )  # [indptr[-1]] int32
        kv_len = layout.context_len + layout.query_len - layout.first_page * c.page_size
        last_page_len = (kv_len - (n - 1) * c.page_size).to(torch.int32)  # in 1..page_size
        common: dict[str, Any] = {
            "window_left": self.window_left,
            "sm_scale": c.softmax_scale,
            "logits_soft_cap": c.softcap,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
        }
        if kind == "decode":
            s.decode.plan(
                indptr,
                indices,
                last_page_len,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.page_size,
                **common,
            )
        else:
            s.prefill.plan(
                layout.query_start,
                indptr,
                indices,
                last_page_len,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.page_size,
                head_dim_vo=c.value_dim,
                causal=True,
                **common,
            )

    def run(
        self,
        q: torch.Tensor,  # [total_query_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, v_head_dim]
        metadata: AttentionMetadata[FlashInferPlan],
        scores: ScoreParams | None = None,
    ) -> torch.Tensor:  # [total_query_tokens, num_heads, v_head_dim]
        check_run_inputs(q, k_cache, v_cache, metadata, scores)
        sinks = self._check_scores(scores)
        if q.dtype != self.dtype or q.device != self.device:
            raise ValueError(
                f"this backend was planned for {self.dtype} on {self.device}, "
                f"got q {q.dtype} on {q.device}"
            )
        plan = metadata.prepared
        s = self._slots[plan.slot]
        if plan.generation != s.generation:
            raise RuntimeError(
                f"stale attention metadata: slot {plan.slot} was planned again since "
                "(a planner keeps at most one step in flight per slot)"
            )
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(s.planned)
        wrapper = s.decode if plan.kind == "decode" else s.prefill
        extra = {} if sinks is None else {"sinks": sinks}
        out: torch.Tensor = wrapper.run(q, (k_cache, v_cache), **extra)
        s.released.record(stream)
        s.ever_run = True
        return out

    def _check_scores(self, scores: ScoreParams | None) -> torch.Tensor | None:
        """The call's sinks (float32 on the device); raises if its scale or soft cap is not the
        one this backend planned with."""
        if scores is None:
            return None
        c = self.config
        if not math.isclose(scores.scale, c.softmax_scale, rel_tol=1e-6):
            raise ValueError(
                f"this FlashInfer backend plans sm_scale {c.softmax_scale}; a call with scale "
                f"{scores.scale} needs a backend of its own"
            )
        if (scores.softcap is None) != (c.softcap is None) or (
            scores.softcap is not None
            and c.softcap is not None
            and not math.isclose(scores.softcap, c.softcap, rel_tol=1e-6)
        ):
            raise ValueError(
                f"this FlashInfer backend plans logits_soft_cap {c.softcap}; a call with "
                f"{scores.softcap} needs a backend of its own"
            )
        if scores.sinks is None:
            return None
        return scores.sinks.to(self.device, torch.float32)
