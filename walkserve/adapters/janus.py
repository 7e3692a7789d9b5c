"""Janus (``transformers.JanusForConditionalGeneration``, unmodified) as a served image generator
whose two guidance contexts are two labels of one request over one paged KV pool.

Owns the decoration of the upstream model: the components around its language model, its
generation head, its image-token embeddings, its vision encoder and its VQ decoder, the walks,
the pool that the language model runs over, random-weight factories and a checkpoint loader.
What crosses its boundary (the walks):

    generate(input_ids [B, T] int64, seed [B] int64) -> image_tokens [B, N],
                                                        image [B, 3, H, W] (about [-1, 1])
    understand(text_ids [B, T], pixel_values [B, 3, H, W], max_new_tokens) -> tokens [B, n]
    pool_usage(probe [B]) -> usage [B, 3]   pages in use, sequences, requests of the pool

``understand`` is upstream's text-mode generation with an image, greedy: one ``"text"`` label
per request in the same pool, a DynamicLoop that stops at EOS.

Upstream ``generate(generation_mode="image")`` runs a batch of 2B (conditioned rows, then the
unconditioned rows whose prompt tokens other than BOS and BOI are pad) through a static cache.
Here the two contexts of request r are the sequences ``SeqId(r, "cond")`` and
``SeqId(r, "uncond")`` of the pool the language-model component owns; each step packs every
context of every request of the batch into one forward (``PagedCausalLMRunner``)::

    kv = kv_open(input_ids)                      [B] int64: handles naming pool requests
    embeds = prompt_embedder(input_ids)          [B, 2, T, D]  cond | uncond prompt embeddings
    rng = seeder(seed)                           [B, S] uint8: one torch.Generator state each
    repeat N = num_image_tokens times (image_step):
        hidden = lm(kv, embeds)                  [B, 2, D]  appends T (then 1) tokens per label
        token, rng = sampler(hidden, rng)        head, CFG + warpers (upstream processors),
                                                 softmax, multinomial with the request's state
        embeds = image_embedder(token)           [B, 2, 1, D]  upstream image-token embedding
        tokens = shift in token                  [B, N]
    tokens = kv_release(kv, tokens)              frees both labels' pages
    image = decoder(tokens)                      upstream decode_image_tokens, channels first

The KV state travelling through the loop is ``kv``: a small int64 tensor, one handle per
request, not an object, so that the batched runtime concatenates the handles of many requests
into one call like any other batched input (objects are batched only when identical). The
handle names ``"janus-<n>"`` in the pool of the component instance that made it; the pool, the
language model, ``kv_open`` and ``kv_release`` share ``GuidanceKV`` and must sit on one rank.
Sampling from a carried generator state reproduces upstream's ``torch.manual_seed(seed)``
followed by ``generate`` token for token (CPU generators; one request per upstream call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from walkserve.capture import iterations, loop, register_component, walk
from walkserve.runtime.kv import hf
from walkserve.runtime.kv.layer_groups import GroupedKVPool
from walkserve.runtime.kv.pool import SeqId

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


class JanusImageWalks(nn.Module):
    """The ``generate`` walk around an upstream ``JanusForConditionalGeneration``. Switches its
    language model's attention to the paged function; everything else runs as upstream."""

    def __init__(
        self,
        janus: Any,  # transformers.JanusForConditionalGeneration
        ids: PromptIds,
        sampling: ImageSampling | None = None,
        pool: PoolSize | None = None,
    ) -> None:
        super().__init__()
        janus.eval().requires_grad_(False)
        language_model = janus.model.language_model
        language_model.config._attn_implementation = hf.register()
        self.kv = GuidanceKV(language_model, pool or PoolSize())
        self.num_image_tokens = int(janus.config.vision_config.num_image_tokens)
        self.kv_open = KVOpen(self.kv, LABELS, ids)
        self.prompt_embedder = PromptEmbedder(janus.get_input_embeddings(), ids)
        self.seeder = Seeder()
        self.lm = PagedLM(language_model, self.kv)
        self.sampler = GuidedSampler(janus.model.generation_head, sampling or ImageSampling())
        self.image_embedder = ImageTokenEmbedder(janus)
        self.kv_release = KVRelease(self.kv)
        self.decoder = ImageDecoder(janus)
        self.kv_usage = KVUsage(self.kv)
        self.eos = int(janus.config.text_config.eos_token_id)
        self.text_open = KVOpen(self.kv, TEXT_LABELS)
        self.understand_embedder = UnderstandEmbedder(janus)
        self.text_head = TextHead(janus.lm_head)
        self.text_embedder = TextEmbedder(janus.get_input_embeddings())

    @walk
    def generate(self, input_ids: Tensor, seed: Tensor) -> dict[str, Tensor]:
        # input_ids: [B, T] int64, ending with BOI; seed: [B] int64
        kv = self.kv_open(input_ids)  # [B]
        embeds = self.prompt_embedder(input_ids)  # [B, 2, T, D]
        rng = self.seeder(seed)  # [B, S]
        tokens = input_ids.new_zeros(input_ids.shape[0], self.num_image_tokens)  # [B, N]
        for _ in range(self.num_image_tokens):
            tokens, embeds, rng = self.image_step(tokens, embeds, rng, kv)
        tokens = self.kv_release(kv, tokens)
        return {"image_tokens": tokens, "image": self.decoder(tokens)}

    @walk
    def understand(
        self, text_ids: Tensor, pixel_values: Tensor, max_new_tokens: int
    ) -> dict[str, Tensor]:
        # text_ids: [B, T] with num_image_tokens image placeholders; pixel_values [B, 3, H, W]
        kv = self.text_open(text_ids)  # [B]: one "text" label each
        embeds = self.understand_embedder(text_ids, pixel_values)  # [B, 1, T, D]
        tokens = []
        for _ in iterations(max_new_tokens):
            embeds, token, done = self.text_step(embeds, kv)
            tokens.append(token)
            if done:
                break
        return {"tokens": self.kv_release(kv, torch.cat(tokens, dim=1))}  # [B, n]

    @loop(max_iters="max_new_tokens", speculative=False)
    def text_step(self, embeds: Tensor, kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.lm(kv, embeds)  # [B, 1, D]
        token = self.text_head(hidden)  # [B, 1], greedy
        done = (token == self.eos).all()  # every sequence emitted EOS
        return self.text_embedder(token), token, done

    @walk
    def pool_usage(self, probe: Tensor) -> dict[str, Tensor]:
        # probe: [B], any values -> usage [B, 3]: pages in use, sequences, requests
        return {"usage": self.kv_usage(probe)}

    @loop
    def image_step(
        self, tokens: Tensor, embeds: Tensor, rng: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.lm(kv, embeds)  # [B, 2, D]
        token, rng = self.sampler(hidden, rng)  # [B, 1]
        embeds = self.image_embedder(token)  # [B, 2, 1, D]
        return torch.cat([tokens[:, 1:], token], dim=1), embeds, rng


# ------------------------------------------------------------------------------ construction

TINY_VOCAB = 320  # byte ids 3..258 (ByteTokenizer), image placeholder 300, BOI 301, EOI 302
TINY_IDS = PromptIds(bos=1, boi=301, pad=0)
TINY_IMAGE_TOKEN = 300


@dataclass(frozen=True)
class JanusSize:
    """The knobs of a random-weight Janus: text model width/depth, image grid, VQ codebook."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    image_size: int = 64  # pixels; the image-token grid is image_size // 16 per side
    codebook: int = 256


TINY = JanusSize()
SMALL = JanusSize(hidden=512, layers=8, heads=8, kv_heads=4, image_size=128, codebook=1024)


def random_janus(size: JanusSize = TINY, seed: int = 0) -> nn.Module:
    """A random-weight ``JanusForConditionalGeneration`` (the facts.md tiny recipe, scaled by
    ``size``): ``(image_size // 16) ** 2`` image tokens from a ``codebook``-entry VQ."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    torch.manual_seed(seed)
    config = JanusConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": TINY_VOCAB,
            "hidden_size": size.hidden,
            "intermediate_size": 2 * size.hidden,
            "num_hidden_layers": size.layers,
            "num_attention_heads": size.heads,
            "num_key_value_heads": size.kv_heads,
            "max_position_embeddings": 1024,
            "bos_token_id": TINY_IDS.bos,
            "eos_token_id": 2,
            "pad_token_id": TINY_IDS.pad,
            "initializer_range": 0.15,  # varied greedy text from random tied embeddings
        },
        vision_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": size.image_size,
            "patch_size": 16,
            "projection_dim": size.hidden,
            "num_image_tokens": (size.image_size // 16) ** 2,
            "depth": 1,
            "mlp_ratio": 2.0,
        },
        vq_config={
            "embed_dim": 8,
            "num_embeddings": size.codebook,
            "base_channels": 32,
            "latent_channels": 16,
            "num_res_blocks": 1,
            "projection_dim": size.hidden,
            "image_token_embed_dim": size.hidden,
            "num_hidden_layers": 1,
        },
        image_token_id=TINY_IMAGE_TOKEN,
    )
    return JanusForConditionalGeneration(config).eval()


def tiny_janus(seed: int = 0) -> nn.Module:
    """The tiny model of the tests: 64x64 images of 16 tokens, hidden 64, 2 layers."""
    return random_janus(TINY, seed)


def sample_inputs(
    prompt: Sequence[int] = (40, 50, 60), size: JanusSize | None = None
) -> dict[str, Any]:
    """Inputs of every walk (``generate``, ``understand``, ``pool_usage``) for the random-weight
    models of ``size`` (default: tiny)."""
    ids = [TINY_IDS.bos, *prompt, TINY_IDS.boi]
    return {
        "input_ids": torch.tensor([ids]),
        "seed": torch.tensor([0]),
        "probe": torch.zeros(1),
        **understand_inputs(prompt, size),
    }


def understand_inputs(
    prompt: Sequence[int] = (40, 50, 60), size: JanusSize | None = None, max_new_tokens: int = 8
) -> dict[str, Any]:
    """Inputs of the ``understand`` walk: BOS, the image placeholders, the prompt; a seeded
    random image in [-1, 1]."""
    size = size or TINY
    n_image = (size.image_size // 16) ** 2
    ids = [TINY_IDS.bos, *[TINY_IMAGE_TOKEN] * n_image, *prompt]
    g = torch.Generator().manual_seed(len(prompt))
    pixels = torch.rand(1, 3, size.image_size, size.image_size, generator=g) * 2 - 1
    return {
        "text_ids": torch.tensor([ids]),
        "pixel_values": pixels,
        "max_new_tokens": max_new_tokens,
    }


def tiny(seed: int = 0) -> tuple[JanusImageWalks, dict[str, Any]]:
    """Zero-argument factory for ``serve("walkserve.adapters.janus:tiny")``."""
    return JanusImageWalks(tiny_janus(seed), TINY_IDS), sample_inputs()


def api_profile(name: str) -> Any:
    """What ``/v1/images/generations`` needs for the random-weight models (``api.profile``
    calls this for ``walkserve.adapters.janus:tiny`` and ``:small``): the toy byte tokenizer,
    wrapped in BOS ... BOI."""
    from walkserve.adapters.tokenizer import ByteTokenizer
    from walkserve.api.profile import ImageTask, ModelProfile

    tok = ByteTokenizer(TINY_IDS.boi - 1)  # bytes lossless below the image specials

    def encode(text: str) -> list[int]:
        return [TINY_IDS.bos, *tok.encode(text), TINY_IDS.boi]

    task = ImageTask(
        walk="generate",
        prompt_input="input_ids",
        noise_input=None,
        noise_shape=(),
        size=(SMALL if name.endswith(":small") else TINY).image_size,
        vocab_size=TINY_VOCAB,
        max_prompt_tokens=256,
        image_output="image",
        encode=encode,
        seed_input="seed",
    )
    return ModelProfile(name, image=task)


def small() -> tuple[JanusImageWalks, dict[str, Any]]:
    """Zero-argument factory of the benchmark model: a ~35M-parameter text model (hidden 512,
    8 layers), 128x128 images of 64 tokens."""
    return JanusImageWalks(random_janus(SMALL), TINY_IDS), sample_inputs(size=SMALL)


def load_janus(
    path: str, sampling: ImageSampling | None = None, pool: PoolSize | None = None
) -> tuple[JanusImageWalks, dict[str, Any]]:
    """A local Janus checkpoint directory (``from_pretrained`` on a path, safetensors). BOS,
    PAD and BOI come from its generation config, as upstream ``generate`` reads them."""
    from transformers import JanusForConditionalGeneration

    janus = JanusForConditionalGeneration.from_pretrained(path, local_files_only=True)
    gen = janus.generation_config
    boi = (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id")
    if boi is None or gen.bos_token_id is None or gen.pad_token_id is None:
        raise ValueError(
            f"{path}: generation_config.json needs bos_token_id, pad_token_id and "
            "generation_kwargs.boi_token_id for image generation"
        )
    if sampling is None and gen.guidance_scale is not None:
        sampling = ImageSampling(guidance_scale=float(gen.guidance_scale))
    ids = PromptIds(bos=int(gen.bos_token_id), boi=int(boi), pad=int(gen.pad_token_id))
    walks = JanusImageWalks(janus, ids, sampling, pool)
    vision: Any = janus.config.vision_config
    placeholders = [int(janus.config.image_token_id)] * int(vision.num_image_tokens)
    return walks, {
        "input_ids": torch.tensor([[ids.bos, ids.boi]]),
        "seed": torch.tensor([0]),
        "probe": torch.zeros(1),
        "text_ids": torch.tensor([[ids.bos, *placeholders]]),
        "pixel_values": torch.zeros(1, 3, vision.image_size, vision.image_size),
        "max_new_tokens": 2,
    }
