"""The decoders of the Omni stacks (Qwen3-Omni's thinker, talker and code predictor; Qwen2.5-Omni's
thinker and talker) on the paged KV pool, so that the concurrent requests of a batch share one
packed forward per step instead of one forward each with its own Hugging Face cache.

Owns ``PagedDecoder``: a ``kv_cache`` component around an unmodified transformers *base* decoder
(the text model under an LM head), fed input embeddings, with a ``forward_batch`` that packs every
call of a ready batch into one row (``hf.PagedCausalLMRunner``'s plan, the attention through
``hf_attention``'s registered function). Subclasses say how a call's embeddings are made (the
upstream forward's own merging: audio and image features scattered at their placeholders,
DeepStack visual features) and which head makes its logits; the calling convention is the
upstream forward's, so the walks call a ``PagedDecoder`` as they called the upstream module:

- in: per request, the upstream keyword arguments the walks use (``input_ids`` or
  ``inputs_embeds`` [B, T, ...], media inputs, ``position_ids`` [R, B, T] or none: then
  ``context .. context + T - 1`` in every row, as upstream's default), ``cache`` (None for a new
  request, else the ``PagedStackKV`` an earlier call returned), ``output_hidden_states``;
- out: ``StackOutput``: ``logits`` [B, 1, V] (the last token's), ``cache`` (the same
  ``PagedStackKV``, updated in place), and with ``output_hidden_states`` the decoder's
  ``hidden_states`` tuple, each [B, T, D], as upstream returns them.

Packed input of one forward (rotary rows R = 4 for Qwen3-Omni: text, t, h, w; 3 for
Qwen2.5-Omni's M-RoPE; each call's own positions, so images' offsets stay per request)::

    calls            A: prefill [1, 5, D]     B: decode [1, 1, D]    C: decode [1, 1, D]
    inputs_embeds    [ a0 a1 a2 a3 a4 | b | c ]                       [1, 7, D]
    position_ids     [R, 1, 7]  (A: its M-RoPE positions; B, C: their step positions)
    visual_pos_masks [1, 7] and DeepStack features: A's image tokens only

The upstream modules stay usable for reference runs in the same process: the decoder's config
says ``attn_implementation`` = the paged one only during a packed forward (``_paged``).
Pages: a request's rows are sequences of the pool, freed when its ``PagedStackKV`` is garbage
collected (the request finished, failed or was cancelled; a release that finds the pool busy is
done at the next forward). A call the pool has no room for now is answered ``DEFER`` (sent again
with a later batch); no eviction or preemption (``runtime.kv.paged_lm.PagedLM`` has them).
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from transformers.utils import ModelOutput

from walkserve.lowering.batched import DEFER, Deferred
from walkserve.runtime.kv.hf import PagedCausalLMRunner, SeqChunk, pool_for
from walkserve.runtime.kv.hf_attention import (
    ModelAttention,
    attention_context,
    probe_attention,
    register,
    text_config,
)
from walkserve.runtime.kv.layer_groups import GroupedKVPool
from walkserve.runtime.kv.paged_lm import (
    DeferredRelease,
    PagedLMConfig,
    PagedLMStats,
    pool_nbytes,
)
from walkserve.runtime.kv.pool_types import SeqId

__all__ = ["PagedDecoder", "PagedStackKV", "PagedThinker", "Prepared", "StackOutput"]

Call = tuple[Sequence[Any], dict[str, Any]]


@dataclass
class StackOutput(ModelOutput):
    """A ``PagedDecoder`` call's result: the fields of upstream's output the walks read."""

    logits: Tensor | None = None  # [B, 1, V]: after each row's last token
    cache: Any = None  # the request's PagedStackKV
    hidden_states: tuple[Tensor, ...] | None = None  # each [B, T, D], with output_hidden_states


@dataclass
class Prepared:
    """One call's decoder input, as upstream's forward builds it before its text model."""

    embeds: Tensor  # [B, T, D]
    positions: Tensor | None = None  # [R, B, T]; None: context .. context + T - 1
    visual_mask: Tensor | None = None  # [B, T] bool: where DeepStack features are added
    deepstack: Sequence[Tensor] | None = None  # per DeepStack layer [visual tokens, D]
    head: int = 0  # which head (the code predictor has one per residual group)


@contextmanager
def _paged(decoder: nn.Module) -> Iterator[None]:
    """The decoder's attention through the paged function for the enclosed forward only."""
    config = text_config(decoder)
    old = config._attn_implementation
    config._attn_implementation = register()
    try:
        yield
    finally:
        config._attn_implementation = old


class _State(DeferredRelease):
    """The pool of one ``PagedDecoder`` in one process, and its live sequences."""

    def __init__(
        self, decoder: nn.Module, config: PagedLMConfig, attention: ModelAttention | None
    ) -> None:
        super().__init__()
        with _paged(decoder):
            if attention is None:
                attention = probe_attention(decoder, embeds=True)
            self.pool: GroupedKVPool = pool_for(
                decoder, config.num_pages, config.page_size, attention=attention
            )
            self.runner = PagedCausalLMRunner(decoder, self.pool)
        self.live: dict[SeqId, bool] = {}  # sequence -> holds pages
        self.calls = 0  # requests' calls run
        self.forwards = 0
        self.tokens = 0

    def _free(self, seqs: list[SeqId]) -> None:  # lock held
        for seq in seqs:
            if self.live.pop(seq, False):
                self.pool.free(seq)


class PagedStackKV:
    """A request's K/V in a ``PagedDecoder``'s pool, one sequence per batch row. Opaque to the
    walks: pass it back to the same component. Its pages go when it is garbage collected."""

    _ids = itertools.count()

    def __init__(self, state: _State, rows: int) -> None:
        request = f"stack{next(PagedStackKV._ids)}"
        self.seqs = [SeqId(request, str(r)) for r in range(rows)]
        self._state = weakref.ref(state)
        for seq in self.seqs:
            state.live[seq] = False
        weakref.finalize(self, state.release, self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def __repr__(self) -> str:
        return f"PagedStackKV({self.seqs[0].request_id}, rows={len(self.seqs)})"


class PagedDecoder(nn.Module):
    """A base decoder over a paged pool (see the module docstring). Subclasses define
    ``forward`` (the upstream keyword arguments they take, ending in a call of
    ``self._call(locals)``), ``prepare`` and ``head``."""

    def __init__(self, decoder: nn.Module, config: PagedLMConfig | None = None) -> None:
        super().__init__()
        self.decoder = decoder
        self.config_kv = config or PagedLMConfig()
        self._attention: ModelAttention | None = None
        self._state: _State | None = None
        self._signature = inspect.signature(self.forward)

    # ------------------------------------------------------------ what subclasses define

    def prepare(self, args: dict[str, Any], context: int) -> Prepared:
        """A call's bound arguments -> its decoder input (``context``: tokens in the pool)."""
        raise NotImplementedError

    def head(self, hidden: Tensor, prepared: Prepared) -> Tensor:
        """[B, 1, D] final hidden states -> [B, 1, V] logits."""
        raise NotImplementedError

    def _call(self, args: dict[str, Any]) -> StackOutput:
        args = {k: v for k, v in args.items() if k in self._signature.parameters}
        out = self.forward_batch([((), args)])[0]
        assert not isinstance(out, Deferred)  # a lone call runs (or raises)
        return out

    # ------------------------------------------------------------ batch

    def forward_batch(self, calls: Sequence[Call]) -> list[Any]:
        """Every call the pool has room for in one packed forward; ``DEFER`` for the rest."""
        state = self._ensure_state()
        with state.lock, torch.no_grad():
            state.drain()
            units = []
            for args, kwargs in calls:
                bound = self._signature.bind(*args, **kwargs).arguments
                cache = self._cache(state, bound)
                context = self._context(state, cache)
                units.append((bound, cache, context, self.prepare(bound, context)))
            out: list[Any] = [DEFER] * len(units)
            chosen = [i for i, u in enumerate(units) if self._reserve(state, u[1], u[3])]
            if not chosen:
                need = max(int(u[3].embeds.shape[1]) + u[2] for u in units)
                raise ValueError(
                    f"a sequence of {need} tokens does not fit the pool of "
                    f"{state.pool.num_pages} pages of {state.pool.page_size}: serve with a "
                    "bigger pool_tokens"
                )
            results = self._forward(state, [units[i] for i in chosen])
            for i, result in zip(chosen, results):
                out[i] = result
            return out

    def _cache(self, state: _State, args: dict[str, Any]) -> PagedStackKV:
        cache = args.get("cache")
        rows = self._rows(args)
        if cache is None:
            return PagedStackKV(state, rows)
        if not isinstance(cache, PagedStackKV) or cache._state() is not state:
            raise ValueError(f"cache must be a PagedStackKV made by this component, got {cache!r}")
        if len(cache) != rows:
            raise ValueError(f"cache has {len(cache)} rows, the input {rows}")
        if any(seq not in state.live for seq in cache.seqs):
            raise ValueError(f"{cache!r} was released")
        return cache

    @staticmethod
    def _rows(args: dict[str, Any]) -> int:
        for name in ("inputs_embeds", "input_ids"):
            x = args.get(name)
            if isinstance(x, Tensor):
                return int(x.shape[0])
        raise ValueError("give input_ids or inputs_embeds")

    @staticmethod
    def _context(state: _State, cache: PagedStackKV) -> int:
        lengths = {state.pool.num_tokens(s) if state.live[s] else 0 for s in cache.seqs}
        if len(lengths) != 1:
            raise ValueError(f"{cache!r}: rows of one request hold different lengths {lengths}")
        return lengths.pop()

    @staticmethod
    def _reserve(state: _State, cache: PagedStackKV, prepared: Prepared) -> bool:
        """Pages for the call's new tokens in every row, or none (the call waits)."""
        pool, new = state.pool, int(prepared.embeds.shape[1])
        need = 0
        for seq in cache.seqs:
            have = pool.num_tokens(seq) if state.live[seq] else 0
            need += pool.pages_for(have + new) - pool.pages_for(have)
        if need > pool.pages_available:
            return False
        for seq in cache.seqs:
            if state.live[seq]:
                pool.append(seq, new)
            else:
                pool.allocate(seq, new)
                state.live[seq] = True
        return True

    def _forward(
        self, state: _State, units: list[tuple[dict[str, Any], PagedStackKV, int, Prepared]]
    ) -> list[StackOutput]:
        """One packed forward of every row of ``units``; each call's ``StackOutput``."""
        device = state.runner.device
        chunks, embeds, positions, visual = [], [], [], []
        rope_rows = max((_rope(p) for *_, p in units), default=0)
        for _, cache, context, p in units:
            rows, new = p.embeds.shape[:2]
            default = torch.arange(context, context + new, device=device)
            for r, seq in enumerate(cache.seqs):
                chunks.append(SeqChunk((), context, seq, p.embeds[r]))
                embeds.append(p.embeds[r].to(device))
                if rope_rows:
                    given = p.positions if _rope(p) else None
                    pos = default.expand(rope_rows, -1) if given is None else given[:, r]
                    positions.append(pos.to(device))
                else:
                    positions.append(default)
                mask = p.visual_mask
                visual.append(
                    mask[r].to(device)
                    if mask is not None
                    else torch.zeros(new, dtype=torch.bool, device=device)
                )
        kwargs: dict[str, Any] = {}
        deep = [p.deepstack for *_, p in units if p.deepstack is not None]
        if deep:
            kwargs["visual_pos_masks"] = torch.cat(visual).unsqueeze(0)  # [1, N]
            kwargs["deepstack_visual_embeds"] = [
                torch.cat([d[layer] for d in deep]).to(device) for layer in range(len(deep[0]))
            ]
        want_hidden = any(bool(u[0].get("output_hidden_states")) for u in units)
        packed = torch.cat(embeds).unsqueeze(0)  # [1, N, D]
        total = packed.shape[1]
        pos = torch.cat(positions, dim=-1)  # [R, N] or [N]
        pos = pos.unsqueeze(-2) if rope_rows else pos.unsqueeze(0)  # [R, 1, N] or [1, N]
        with _paged(self.decoder), attention_context(state.runner.plan(chunks)):
            out = self.decoder(
                inputs_embeds=packed,
                position_ids=pos,
                attention_mask=torch.ones(1, total, dtype=torch.long, device=device),
                use_cache=False,
                output_hidden_states=want_hidden or None,
                **kwargs,
            )
        last_hidden = out.last_hidden_state[0]  # [N, D]
        results, start = [], 0
        for bound, cache, _, p in units:
            rows, new = p.embeds.shape[:2]
            spans = [(start + r * new, start + (r + 1) * new) for r in range(rows)]
            start += rows * new
            for seq in cache.seqs:
                state.pool.mark_computed(seq)
            last = torch.stack([last_hidden[b - 1] for _, b in spans]).unsqueeze(1)  # [B, 1, D]
            hidden = None
            if bound.get("output_hidden_states"):
                hidden = tuple(
                    torch.stack([h[0, a:b] for a, b in spans]) for h in out.hidden_states
                )
            results.append(StackOutput(self.head(last, p), cache, hidden))
        state.calls += len(units)
        state.forwards += 1
        state.tokens += total
        return results

    # ------------------------------------------------------------ the KVEngine protocol

    def _ensure_state(self) -> _State:
        if self._state is None:
            self._state = _State(self.decoder, self.config_kv, self._attention)
        return self._state

    def release_kv(self) -> None:
        """Drop the pool (a process that only captured); live caches become unusable."""
        self._state = None

    def kv_pool_nbytes(self, tensor_parallel: int = 1) -> int:
        """Bytes of the pool this component allocates per process (probes once, if needed)."""
        if self._attention is None:
            with _paged(self.decoder):
                self._attention = probe_attention(self.decoder, embeds=True)
        itemsize = next(self.decoder.parameters()).element_size()
        return pool_nbytes(self._attention, self.config_kv, itemsize, tensor_parallel)

    def packing(self) -> tuple[int, int]:
        """(calls run, forwards run) in this process: more calls than forwards is requests
        sharing forwards."""
        state = self._state
        return (0, 0) if state is None else (state.calls, state.forwards)

    def kv_stats(self, wait: bool = True) -> PagedLMStats | None:
        state = self._state
        if state is None or not state.lock.acquire(blocking=wait):
            return None
        try:
            state.drain()
            pool = state.pool.stats()
            return PagedLMStats(
                pages_in_use=pool.pages_in_use,
                pages_cached=pool.pages_cached,
                num_pages=state.pool.num_pages,
                live_sequences=len(state.live),
                evictions=0,
                prefix_hits=pool.prefix_hits,
                forwards=state.forwards,
                tokens_forwarded=state.tokens,
            )
        finally:
            state.lock.release()


class Merged(NamedTuple):
    """A thinker call's input embeddings with its media merged (``PagedThinker.merge_media``)."""

    embeds: Tensor  # [B, T, D]
    image_mask: Tensor | None  # [B, T] bool: the image placeholders; None without images
    image: Any  # upstream's get_image_features output; None without images
    video_mask: Tensor | None  # [B, T] bool: the video placeholders; None without videos
    video: Any  # upstream's get_video_features output; None without videos


class PagedThinker(PagedDecoder):
    """An Omni thinker (``thinker.model.language_model`` under ``thinker.lm_head``) fed the
    embeddings of its input, as upstream's thinker forward merges them: audio features
    (``get_audio_features``), video features (``get_video_features``) and image features
    (``get_image_features``) scattered at their placeholders (``get_placeholder_mask``). Qwen3-Omni's adds DeepStack
    (``qwen3_omni.decoders``)."""

    def __init__(self, thinker: Any, config: PagedLMConfig | None = None) -> None:
        super().__init__(thinker.model.language_model, config)
        self.thinker = thinker

    def forward(
        self,
        input_ids: Tensor,
        cache: Any = None,
        use_cache: bool = True,
        position_ids: Tensor | None = None,
        input_features: Tensor | None = None,
        feature_attention_mask: Tensor | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        output_hidden_states: bool = False,
        pixel_values_videos: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
    ) -> StackOutput:
        return self._call(locals())

    def prepare(self, args: dict[str, Any], context: int) -> Prepared:
        merged = self.merge_media(args)
        return Prepared(merged.embeds, args.get("position_ids"), merged.image_mask)

    def merge_media(self, args: dict[str, Any]) -> Merged:
        """The call's input embeddings with its media features at their placeholders (audio,
        video, images), and the vision tower's outputs (for DeepStack)."""
        model = self.thinker.model
        ids = args["input_ids"]
        embeds = model.get_input_embeddings()(ids)  # [B, T, D]
        if args.get("input_features") is not None:
            audio = model.get_audio_features(
                args["input_features"], args.get("feature_attention_mask"), None, return_dict=True
            ).last_hidden_state
            _, _, mask = model.get_placeholder_mask(ids, inputs_embeds=embeds)
            embeds = embeds.masked_scatter(mask, audio.to(embeds.device, embeds.dtype))
        if args.get("pixel_values_videos") is not None:  # as upstream's get_video_features
            video = model.get_video_features(
                args["pixel_values_videos"], args.get("video_grid_thw"), return_dict=True
            )
            found = torch.cat(video.pooler_output, dim=0).to(embeds.device, embeds.dtype)
            _, mask, _ = model.get_placeholder_mask(ids, inputs_embeds=embeds, video_features=found)
            embeds = embeds.masked_scatter(mask, found)
            videos = (mask[..., 0], video)
        else:
            videos = (None, None)
        if args.get("pixel_values") is None:
            return Merged(embeds, None, None, *videos)
        image = model.get_image_features(
            args["pixel_values"], args.get("image_grid_thw"), return_dict=True
        )
        features = torch.cat(image.pooler_output, dim=0).to(embeds.device, embeds.dtype)
        mask, _, _ = model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=features)
        return Merged(embeds.masked_scatter(mask, features), mask[..., 0], image, *videos)

    def head(self, hidden: Tensor, prepared: Prepared) -> Tensor:
        logits: Tensor = self.thinker.lm_head(hidden)
        return logits


def _rope(p: Prepared) -> int:
    """How many rotary rows the call gives (its ``positions`` [R, B, T]); 0: none."""
    given = p.positions
    return int(given.shape[0]) if given is not None and given.dim() == 3 else 0
