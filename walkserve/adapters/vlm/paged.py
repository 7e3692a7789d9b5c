"""``PagedVLM``: the language model of an upstream vision-language model on the paged KV pool,
fed image features at their placeholder tokens. It is a ``runtime.kv.paged_lm.PagedLM`` (the
same packing, scheduling, eviction with recompute, sampling and prefix cache) whose rows of
image requests keep their media (``_Row.extra``) and whose forward feeds embeddings:

- in: ``PagedLM``'s call, plus for a new request ``image_features`` [image tokens, D] and
  ``image_keys`` [images, 2] (``encoder.VisionTower``'s outputs) and ``image_grid_thw``
  [images, 3]; a request's rows take its images in order, each row as many as its
  placeholders need;
- out: ``PagedLM``'s (token [B, 1], cache).

Per image row (``RowMedia``): the prompt positions of its image tokens and their features
(scattered into the token embeddings there, as upstream's forward does with
``masked_scatter``), its rotary positions (Qwen's M-RoPE: upstream ``get_rope_index`` for the
prompt, ``t + delta`` after it, as ``generate()`` continues), and its prefix ids: the prompt
with every placeholder of image ``i`` replaced by ``-1 - key_i`` (the image's content key; real
ids are >= 0), so that full KV pages are shared exactly when the text and the images before
and in them are the same (vLLM keys its blocks by the multimodal hashes likewise). Text
requests run as ``PagedLM``'s, through the same packed forward::

    calls        A: image prefill [1, 7]                B: decode [1, 1]
    embeds       [ t t I I I I t | b ]                  I: A's image features
    positions    [3, 1, 8]  (A: M-RoPE of its prompt; B: its step + its delta)
    prefix ids   A: [t t -k -k -k -k t]                 k: A's image key
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.vlm.families import Family
from walkserve.runtime.kv.grammar import Vocabulary
from walkserve.runtime.kv.hf import SeqChunk
from walkserve.runtime.kv.hf_attention import attention_context
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

__all__ = ["PagedVLM", "RowMedia"]


@dataclass(frozen=True)
class RowMedia:
    """A prompt row's images, kept for every forward of the row (recompute included)."""

    slots: Tensor  # [n] int64: prompt positions of the image tokens, ascending
    features: Tensor  # [n, D]
    prefix_ids: list[int]  # the prompt, each image's placeholders as -1 - its key
    rope: Tensor | None  # [3, P] M-RoPE positions of the prompt; None: 1-D positions
    delta: int  # position of token t >= P: t + delta


class PagedVLM(PagedLM):
    """``model`` (an upstream ``*ForConditionalGeneration`` VLM) on the pool; see the module
    docstring."""

    def __init__(
        self,
        model: nn.Module,
        family: Family,
        config: PagedLMConfig | None = None,
        *,
        stop_ids: tuple[int, ...] = (),
        vocabulary: Vocabulary | None = None,
    ) -> None:
        super().__init__(model, config, stop_ids=stop_ids, vocabulary=vocabulary)
        self.family = family

    def forward(  # type: ignore[override]
        self,
        input_ids: Tensor,  # [B, T] int64
        cache: Any = None,
        step: int | Tensor = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        min_tokens: int = 0,
        constraints: Tensor | None = None,
        logprobs: int = 0,
        with_logprobs: bool = False,
        image_features: Tensor | None = None,  # [image tokens, D]
        image_keys: Tensor | None = None,  # [images, 2]: content key, tokens
        image_grid_thw: Tensor | None = None,  # [images, 3]
    ) -> Any:
        args = (input_ids, cache, step, temperature, top_p, top_k, seed, repetition_penalty)
        kwargs = {
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "min_tokens": min_tokens,
            "constraints": constraints,
            "logprobs": logprobs,
            "with_logprobs": with_logprobs,
            "image_features": image_features,
            "image_keys": image_keys,
            "image_grid_thw": image_grid_thw,
        }
        return self.forward_batch([(args, kwargs)])[0]

    # ------------------------------------------------------------ PagedLM's hooks

    def _start_rows(self, rows: list[Any], ids: Tensor, args: dict[str, Any]) -> None:
        super()._start_rows(rows, ids, args)
        features = args.get("image_features")
        if features is None:
            return
        keys, grid = args.get("image_keys"), args.get("image_grid_thw")
        if keys is None or grid is None:
            raise ValueError("image_features need image_keys and image_grid_thw")
        if len(keys) != len(grid) or int(keys[:, 1].sum()) != features.shape[0]:
            raise ValueError(
                f"{len(keys)} image keys, {len(grid)} grid rows and {features.shape[0]} image"
                f" features for {int(keys[:, 1].sum())} image tokens do not agree"
            )
        # Rows take the images in order, each as many as its placeholders need.
        image, token = 0, 0
        for r, row in enumerate(rows):
            need = int((ids[r] == self.family.image_token).sum())
            first = image
            while need > 0 and image < len(keys):
                need -= int(keys[image, 1])
                image += 1
            if need != 0:
                raise ValueError(
                    f"prompt row {r}: its image tokens are not a whole number of the images'"
                    " tokens (lay out each image's placeholders as its processor does)"
                )
            count = int(keys[first:image, 1].sum())
            if count:
                row.extra = self._media(
                    ids[r], features[token : token + count], keys[first:image], grid[first:image]
                )
            token += count
        if image != len(keys):
            raise ValueError(f"{len(keys) - image} image(s) have no placeholders in the prompt")

    def _media(self, ids: Tensor, features: Tensor, keys: Tensor, grid: Tensor) -> RowMedia:
        family = self.family
        slots = (ids == family.image_token).nonzero().reshape(-1)
        counts = [int(c) for c in keys[:, 1]]
        if not (len(slots) == features.shape[0] == sum(counts)) or len(counts) != len(grid):
            raise ValueError(
                f"the prompt holds {len(slots)} image tokens, the images' features "
                f"{features.shape[0]} ({len(counts)} images, {len(grid)} grid rows)"
            )
        prefix = ids.tolist()
        at = 0
        for key, count in keys.tolist():
            for slot in slots[at : at + count].tolist():
                prefix[slot] = -1 - key
            at += count
        rope, delta = None, 0
        if family.mrope:
            rope, delta = family.rope(self.lm, ids, grid.to(torch.int64))
        return RowMedia(slots, features, prefix, rope, delta)

    def _prefix_ids(self, row: Any, want: list[int]) -> list[int]:
        media: RowMedia | None = row.extra
        if media is None:
            return want
        return media.prefix_ids + want[len(media.prefix_ids) :]

    def _logits(self, state: Any, rows: list[Any], chunks: list[SeqChunk]) -> Tensor:
        device = state.runner.device
        embed = self.lm.get_input_embeddings()  # type: ignore[operator]
        embeds, positions, last = [], [], []
        total = 0
        for row, chunk in zip(rows, chunks):
            start, end = chunk.context_len, chunk.context_len + len(chunk.token_ids)
            e = embed(torch.tensor(chunk.token_ids, device=device))  # [n, D]
            media: RowMedia | None = row.extra
            if media is not None:
                inside = (media.slots >= start) & (media.slots < end)
                if bool(inside.any()):
                    e = e.clone()
                    e[media.slots[inside] - start] = media.features[inside].to(e.device, e.dtype)
            embeds.append(e)
            positions.append(self._positions(media, start, end).to(device))
            total += end - start
            last.append(total - 1)
        pos = torch.cat(positions, dim=-1)  # [3, N] or [N]
        pos = pos.unsqueeze(1) if self.family.mrope else pos.unsqueeze(0)  # [3, 1, N] | [1, N]
        with attention_context(state.runner.plan(chunks)):
            out = self.lm(
                inputs_embeds=torch.cat(embeds).unsqueeze(0),  # [1, N, D]
                position_ids=pos,
                attention_mask=torch.ones(1, total, dtype=torch.long, device=device),
                use_cache=False,
                logits_to_keep=torch.tensor(last, device=device),
            )
        logits: Tensor = out.logits[0]  # [rows, vocab]
        return logits

    def _positions(self, media: RowMedia | None, start: int, end: int) -> Tensor:
        t = torch.arange(start, end)
        if not self.family.mrope:
            return t
        if media is None or media.rope is None:
            return t.expand(3, -1)
        out = (t + media.delta).expand(3, -1).clone()
        prompt = t < media.rope.shape[1]
        out[:, prompt] = media.rope[:, t[prompt]].to(out.dtype)
        return out
