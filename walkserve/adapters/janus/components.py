"""The components of the Janus walks (see the package docstring): the guidance KV pool
over upstream's language model, the samplers, embedders and decoders, each wrapping upstream
modules unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from walkserve.capture import register_component
from walkserve.runtime.kv import hf
from walkserve.runtime.kv.layer_groups import GroupedKVPool
from walkserve.runtime.kv.pool_types import SeqId

LABELS = ("cond", "uncond")  # guidance contexts, in upstream's row order
TEXT_LABELS = ("text",)  # the one context of image understanding


@dataclass(frozen=True)
class ImageSampling:
    """Upstream's image-mode sampling knobs (``GenerationConfig`` fields of the same names)."""

    guidance_scale: float = 5.0
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    do_sample: bool = True

    def __post_init__(self) -> None:
        if not self.guidance_scale > 1:
            raise ValueError(f"guidance_scale must be > 1 for CFG, got {self.guidance_scale}")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"need temperature > 0, 0 < top_p <= 1, top_k >= 0; got {self.temperature}, "
                f"{self.top_p}, {self.top_k}"
            )

    def processors(self) -> Any:
        """The logits processors upstream ``generate`` builds for these values, in its order."""
        from transformers.generation import logits_process as lp

        out = lp.LogitsProcessorList(
            [lp.ClassifierFreeGuidanceLogitsProcessor(self.guidance_scale)]
        )
        if self.do_sample and self.temperature != 1.0:
            out.append(lp.TemperatureLogitsWarper(self.temperature))
        if self.do_sample and self.top_k != 0:
            out.append(lp.TopKLogitsWarper(self.top_k))
        if self.do_sample and self.top_p < 1.0:
            out.append(lp.TopPLogitsWarper(self.top_p))
        return out


@dataclass(frozen=True)
class PromptIds:
    """Special ids upstream reads from the generation config: the unconditioned prompt keeps
    BOS and BOI (begin of image) and turns every other token into PAD."""

    bos: int
    boi: int
    pad: int


@dataclass(frozen=True)
class PoolSize:
    num_pages: int = 128
    page_size: int = 16


def guidance_ids(input_ids: Tensor, ids: PromptIds) -> Tensor:
    """input_ids [B, T] -> [B, 2, T]: the conditioned prompt and upstream's unconditioned one
    (only BOS and BOI kept, the rest PAD)."""
    keep = (input_ids == ids.bos) | (input_ids == ids.boi)
    return torch.stack([input_ids, input_ids.masked_fill(~keep, ids.pad)], dim=1)


class GuidanceKV:
    """The paged pool of one language-model instance and the handles naming its requests.

    A context opened with its prompt's token ids (the guidance contexts of ``generate``, whose
    embeddings are those ids' text embeddings) gets its pages at its first step, reusing the
    cached full pages of an identical prompt prefix (``allocate_with_prefix``): a second request
    with the same prompt, or the unconditioned contexts of any two requests with prompts of one
    length, computes only what is new. A context opened without ids (``understand``: image
    features in its embeddings) starts empty and is never shared.

    The pool is allocated on first use (in the worker that runs the component), once."""

    def __init__(self, language_model: nn.Module, size: PoolSize) -> None:
        self.language_model = language_model
        self.size = size
        self._runner: hf.PagedCausalLMRunner | None = None
        self._next = 0
        self._labels: dict[int, tuple[str, ...]] = {}
        self._prompts: dict[SeqId, list[int]] = {}  # opened with ids, not allocated yet
        self._namespace = f"janus:{id(self)}"

    @property
    def runner(self) -> hf.PagedCausalLMRunner:
        if self._runner is None:
            pool = hf.pool_for(self.language_model, self.size.num_pages, self.size.page_size)
            self._runner = hf.PagedCausalLMRunner(self.language_model, pool)
        return self._runner

    @property
    def pool(self) -> GroupedKVPool:
        return self.runner.pool

    @staticmethod
    def request_id(handle: int) -> str:
        return f"janus-{handle}"

    def open(self, n: int, labels: Sequence[str], prompt_ids: Tensor | None = None) -> list[int]:
        """``n`` new requests with ``labels``; ``prompt_ids`` [n, len(labels), T]: each
        context's prompt token ids, for prefix reuse (None: contexts start empty)."""
        handles = list(range(self._next, self._next + n))
        self._next += n
        for row, h in enumerate(handles):
            self._labels[h] = tuple(labels)
            for j, label in enumerate(labels):
                seq = SeqId(self.request_id(h), label)
                if prompt_ids is None:
                    self.pool.allocate(seq, 0)
                else:
                    self._prompts[seq] = [int(t) for t in prompt_ids[row, j].tolist()]
        return handles

    def step(self, handles: Sequence[int], embeds: Tensor) -> Tensor:
        # embeds: [B, L, T, D], one row per label in opening order -> last hidden [B, L, D]
        b, n_labels, t, d = embeds.shape
        chunks = []
        for row, h in enumerate(handles):
            labels = self._labels.get(h, ())
            if len(labels) != n_labels:
                raise ValueError(f"request {h} has labels {labels}, got {n_labels} embeddings")
            for j, label in enumerate(labels):
                seq = SeqId(self.request_id(h), label)
                prompt = self._prompts.pop(seq, None)
                if prompt is not None:  # its first step: the prompt, past its cached prefix
                    if len(prompt) != t:
                        raise ValueError(f"{seq}: prompt of {len(prompt)} ids, {t} embeddings")
                    context = self.pool.allocate_with_prefix(
                        seq, prompt, namespace=self._namespace, max_cached_tokens=t - 1
                    )
                    chunks.append(hf.SeqChunk((), context, seq, embeds[row, j, context:]))
                    continue
                context = self.pool.num_tokens(seq)
                self.pool.append(seq, t)
                chunks.append(hf.SeqChunk((), context, seq, embeds[row, j]))
        hidden = self.runner.last_hidden_states(chunks).view(b, n_labels, d)
        for c in chunks:
            self.pool.mark_computed(c.seq)  # registers the prompt's full pages for reuse
        return hidden

    def close(self, handles: Sequence[int]) -> None:
        for h in handles:
            self.pool.free_request(self.request_id(h))
            for label in self._labels.pop(h, ()):
                self._prompts.pop(SeqId(self.request_id(h), label), None)


class KVOpen(nn.Module):
    """input_ids [B, T] -> handles [B] int64: B new requests, each with ``labels``; with
    ``ids``, the guidance contexts of ``input_ids`` (``guidance_ids``), reusing cached prompt
    prefixes; else empty."""

    def __init__(self, kv: GuidanceKV, labels: Sequence[str], ids: PromptIds | None = None):
        super().__init__()
        self.kv = kv
        self.labels = tuple(labels)
        self.ids = ids

    def forward(self, input_ids: Tensor) -> Tensor:
        prompts = None if self.ids is None else guidance_ids(input_ids, self.ids)
        handles = self.kv.open(input_ids.shape[0], self.labels, prompts)
        return torch.tensor(handles, dtype=torch.int64)


class PagedLM(nn.Module):
    """handles [B], embeds [B, 2, T, D] -> hidden [B, 2, D]: one packed forward of the
    upstream language model over both labels of every request, appending T tokens each."""

    def __init__(self, language_model: nn.Module, kv: GuidanceKV) -> None:
        super().__init__()
        self.language_model = language_model
        self.kv = kv

    def forward(self, handles: Tensor, embeds: Tensor) -> Tensor:
        return self.kv.step(handles.tolist(), embeds)


class KVRelease(nn.Module):
    """handles [B], tokens [B, N] -> tokens: frees the requests' pages once the loop is done
    (the tokens pass through so that the release is ordered after the last step)."""

    def __init__(self, kv: GuidanceKV) -> None:
        super().__init__()
        self.kv = kv

    def forward(self, handles: Tensor, tokens: Tensor) -> Tensor:
        self.kv.close(handles.tolist())
        return tokens


class KVUsage(nn.Module):
    """probe [B] -> [B, 3] int64: (pages in use, sequences, requests) of the pool, for
    checking from outside a worker that served requests left nothing behind."""

    def __init__(self, kv: GuidanceKV) -> None:
        super().__init__()
        self.kv = kv

    def forward(self, probe: Tensor) -> Tensor:
        s = self.kv.pool.stats()
        return torch.tensor([[s.pages_in_use, s.sequences, s.requests]]).expand(len(probe), -1)


class PromptEmbedder(nn.Module):
    """input_ids [B, T] -> embeds [B, 2, T, D]: the conditioned prompt and upstream's
    unconditioned one (only BOS and BOI kept, the rest PAD), through the text embeddings."""

    def __init__(self, embed_tokens: Any, ids: PromptIds) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.ids = ids

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(guidance_ids(input_ids, self.ids))


class Seeder(nn.Module):
    """seed [B] int64 -> rng [B, S] uint8: the state of ``torch.Generator().manual_seed(s)``."""

    def forward(self, seed: Tensor) -> Tensor:
        states = [torch.Generator().manual_seed(int(s)).get_state() for s in seed.tolist()]
        return torch.stack(states)


class GuidedSampler(nn.Module):
    """hidden [B, 2, D], rng [B, S] -> token [B, 1] int64, rng [B, S]: upstream's generation
    head, its logits processors (CFG first), softmax and multinomial, per request with its own
    generator state."""

    def __init__(self, generation_head: nn.Module, sampling: ImageSampling) -> None:
        super().__init__()
        self.generation_head = generation_head
        self.sampling = sampling
        self.processors = sampling.processors()

    def forward(self, hidden: Tensor, rng: Tensor) -> tuple[Tensor, Tensor]:
        tokens, states = [], []
        generator = torch.Generator()
        for h, state in zip(hidden, rng):
            scores = self.generation_head(h)  # [2, V]: cond, uncond
            scores = self.processors(h.new_zeros(1, 1, dtype=torch.long), scores)  # [1, V]
            if self.sampling.do_sample:
                generator.set_state(state.clone())  # own storage: set_state ignores offsets
                probs = torch.softmax(scores, dim=-1)
                tokens.append(torch.multinomial(probs, num_samples=1, generator=generator))
                states.append(generator.get_state())
            else:
                tokens.append(scores.argmax(-1, keepdim=True))
                states.append(state)
        return torch.cat(tokens), torch.stack(states)


class ImageTokenEmbedder(nn.Module):
    """token [B, 1] -> embeds [B, 2, 1, D]: upstream's image-token embedding, fed to both
    contexts."""

    janus: Any  # transformers.JanusForConditionalGeneration

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.janus = janus

    def forward(self, token: Tensor) -> Tensor:
        embeds = self.janus.prepare_embeddings_for_image_generation(token)  # [B, 1, D]
        return embeds.unsqueeze(1).expand(-1, len(LABELS), -1, -1)


class UnderstandEmbedder(nn.Module):
    """input_ids [B, T] with ``image_token_id`` placeholders, pixel_values [B, 3, H, W] ->
    embeds [B, 1, T, D]: the text embeddings with the aligned vision features scattered into
    the placeholders, by upstream's own ``get_image_features`` and ``get_placeholder_mask``."""

    janus: Any  # transformers.JanusForConditionalGeneration

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.janus = janus

    def forward(self, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
        embeds = self.janus.get_input_embeddings()(input_ids)  # [B, T, D]
        features = self.janus.model.get_image_features(pixel_values).pooler_output
        features = features.reshape(-1, embeds.shape[-1]).to(embeds.dtype)  # [B * n_img, D]
        mask = self.janus.model.get_placeholder_mask(
            input_ids, inputs_embeds=embeds, image_features=features
        )
        return embeds.masked_scatter(mask, features).unsqueeze(1)


class TextHead(nn.Module):
    """hidden [B, 1, D] -> token [B, 1]: upstream's LM head, greedy."""

    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden[:, 0]).argmax(-1, keepdim=True)


class TextEmbedder(nn.Module):
    """token [B, 1] -> embeds [B, 1, 1, D]: the text embeddings of the next input."""

    def __init__(self, embed_tokens: Any) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, token: Tensor) -> Tensor:
        return self.embed_tokens(token).unsqueeze(1)


class ImageDecoder(nn.Module):
    """tokens [B, N] -> image [B, 3, H, W]: upstream ``decode_image_tokens``, channels first.
    One request at a time: batched convolutions of the ~20-layer VQ decoder reassociate sums by
    ~1e-5 relative (measured), over ``walkserve.testing``'s rule; a request's pixels then do
    not depend on what it was batched with."""

    janus: Any  # transformers.JanusForConditionalGeneration

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.janus = janus

    def forward(self, tokens: Tensor) -> Tensor:
        images = [self.janus.decode_image_tokens(t[None]) for t in tokens]  # [1, H, W, 3] each
        return torch.cat(images).permute(0, 3, 1, 2)


for _kv in (KVOpen, PagedLM, KVRelease, KVUsage):
    register_component(_kv, engine="kv_cache", speculative=False)
for _stateless in (
    PromptEmbedder,
    Seeder,
    GuidedSampler,
    ImageTokenEmbedder,
    ImageDecoder,
    UnderstandEmbedder,
    TextHead,
    TextEmbedder,
):
    register_component(_stateless, engine="stateless")
