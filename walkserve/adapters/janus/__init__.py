"""Janus (``transformers.JanusForConditionalGeneration``, unmodified) as a served image generator
whose two guidance contexts are two labels of one request over one paged KV pool.

Owns the decoration of the upstream model: the components around its language model, its
generation head, its image-token embeddings, its vision encoder and its VQ decoder, the walks,
the pool that the language model runs over, random-weight factories and a checkpoint loader.
What crosses its boundary (the walks):

    generate(input_ids [B, T] int64, seed [B] int64) -> image_tokens [B, N],
                                                        image [B, 3, H, W] (about [-1, 1])
    understand(text_ids [B, T], pixel_values [B, 3, H, W], max_new_tokens) -> tokens [B, n]
    chat(text_ids [B, T], max_new_tokens) -> tokens (streamed), released
    chat_image(text_ids [B, T], pixel_values [B, 3, H, W], max_new_tokens) -> as chat
    pool_usage(probe [B]) -> usage [B, 3]   pages in use, sequences, requests of the pool

``understand`` is upstream's text-mode generation with an image, greedy: one ``"text"`` label
per request in the same pool, a DynamicLoop that stops at EOS. ``chat`` and ``chat_image``
serve it through ``/v1/chat/completions`` (``chat.py``: the image processor and
``<image_placeholder>`` expansion of upstream's ``JanusProcessor``); a checkpoint directory's
chat profile (its own ``JanusProcessor``: tokenizer, chat template, image processor) is
``checkpoint.py``, its ``/v1/images/generations`` task (the processor's prompts for
``generation_mode="image"`` and its ``postprocess``) ``image_generation.py``.

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

from walkserve.adapters.janus.build import (
    SMALL,
    TINY,
    TINY_EOI,
    TINY_EOS,
    TINY_IDS,
    TINY_IMAGE_TOKEN,
    TINY_VOCAB,
    JanusSize,
    api_profile,
    load_janus,
    random_janus,
    sample_inputs,
    small,
    tiny,
    tiny_janus,
    understand_inputs,
)
from walkserve.adapters.janus.components import (
    LABELS,
    TEXT_LABELS,
    GuidanceKV,
    GuidedSampler,
    ImageDecoder,
    ImageSampling,
    ImageTokenEmbedder,
    KVOpen,
    KVRelease,
    KVUsage,
    PagedLM,
    PoolSize,
    PromptEmbedder,
    PromptIds,
    Seeder,
    TextEmbedder,
    TextHead,
    UnderstandEmbedder,
    guidance_ids,
)
from walkserve.adapters.janus.walks import JanusImageWalks

__all__ = [
    "GuidanceKV",
    "GuidedSampler",
    "ImageDecoder",
    "ImageSampling",
    "ImageTokenEmbedder",
    "JanusImageWalks",
    "JanusSize",
    "KVOpen",
    "KVRelease",
    "KVUsage",
    "LABELS",
    "PagedLM",
    "PoolSize",
    "PromptEmbedder",
    "PromptIds",
    "SMALL",
    "Seeder",
    "TEXT_LABELS",
    "TINY",
    "TINY_IDS",
    "TINY_EOI",
    "TINY_EOS",
    "TINY_IMAGE_TOKEN",
    "TINY_VOCAB",
    "TextEmbedder",
    "TextHead",
    "UnderstandEmbedder",
    "api_profile",
    "guidance_ids",
    "load_janus",
    "random_janus",
    "sample_inputs",
    "small",
    "tiny",
    "tiny_janus",
    "understand_inputs",
]
