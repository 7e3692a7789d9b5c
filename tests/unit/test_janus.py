"""Janus image generation over the paged KV pool against upstream transformers, in process.

The adapter's model and the reference are two instances of the same seeded tiny
``JanusForConditionalGeneration``; the reference keeps transformers' own attention and cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve import capture  # noqa: E402
from walkserve.adapters import janus  # noqa: E402

PROMPT = (40, 50, 60, 70)


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return janus.tiny_janus(0)


@pytest.fixture(scope="module")
def walks() -> janus.JanusImageWalks:
    return janus.tiny(0)[0]


def upstream_tokens(
    ref: torch.nn.Module, ids: torch.Tensor, seed: int, s: janus.ImageSampling
) -> torch.Tensor:
    config = transformers.GenerationConfig(
        bos_token_id=janus.TINY_IDS.bos,
        pad_token_id=janus.TINY_IDS.pad,
        do_sample=s.do_sample,
        guidance_scale=s.guidance_scale,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        generation_kwargs={"boi_token_id": janus.TINY_IDS.boi},
    )
    torch.manual_seed(seed)
    return ref.generate(
        ids, attention_mask=torch.ones_like(ids), generation_mode="image", generation_config=config
    )  # [1, N]


@pytest.mark.parametrize(
    "sampling",
    [janus.ImageSampling(), janus.ImageSampling(3.0, temperature=0.7, top_k=20, top_p=0.9)],
    ids=["defaults", "warped"],
)
def test_image_tokens_and_pixels_equal_upstream(ref, sampling) -> None:
    walks = janus.JanusImageWalks(janus.tiny_janus(0), janus.TINY_IDS, sampling)
    ids = janus.sample_inputs(PROMPT)["input_ids"]
    for seed in (0, 7):
        want = upstream_tokens(ref, ids, seed, sampling)
        with torch.no_grad():
            out = walks.generate(ids, torch.tensor([seed]))
        assert torch.equal(out["image_tokens"], want), (seed, out["image_tokens"], want)
        with torch.no_grad():
            pixels = ref.decode_image_tokens(want).permute(0, 3, 1, 2)  # [1, 3, 64, 64]
        assert torch.equal(out["image"], pixels)
    assert walks.kv.pool.pages_in_use == 0


def test_batch_of_requests_equals_each_alone(ref, walks) -> None:
    """Two requests with different seeds in one walk call: one packed forward per step over
    four labelled contexts; each request's tokens are upstream's for it alone."""
    ids = janus.sample_inputs(PROMPT)["input_ids"]
    with torch.no_grad():
        out = walks.generate(ids.repeat(2, 1), torch.tensor([3, 4]))
    for row, seed in enumerate((3, 4)):
        want = upstream_tokens(ref, ids, seed, janus.ImageSampling())
        assert torch.equal(out["image_tokens"][row : row + 1], want)


def test_guidance_contexts_are_two_labels_of_one_pool(walks, monkeypatch) -> None:
    seen: list[tuple[int, list[str], bool]] = []
    step = janus.GuidanceKV.step

    def spy(kv: janus.GuidanceKV, handles, embeds):  # type: ignore[no-untyped-def]
        out = step(kv, handles, embeds)
        for h in handles:
            rid = kv.request_id(h)
            cond, uncond = (kv.pool.block_table((rid, label)) for label in janus.LABELS)
            private = not set(cond.pages) & set(uncond.pages)  # each label its own pages
            seen.append((id(kv.pool), kv.pool.labels(rid), private))
        return out

    captured = capture.trace(walks, janus.sample_inputs(PROMPT))
    monkeypatch.setattr(janus.GuidanceKV, "step", spy)
    captured.run(janus.sample_inputs(PROMPT), walk="generate")
    assert len(seen) >= walks.num_image_tokens
    assert {pool for pool, _, _ in seen} == {id(walks.kv.pool)}  # one pool object
    assert all(labels == ["cond", "uncond"] for _, labels, _ in seen)
    assert all(private for _, _, private in seen)
    assert walks.lm.kv is walks.kv_open.kv is walks.kv_release.kv is walks.kv
    assert walks.kv.pool.pages_in_use == 0 and walks.kv.pool.stats().sequences == 0


def test_two_labels_over_one_pool_attend_like_two_dense_caches(ref, walks) -> None:
    """The pool's cond and uncond contexts give the language model the same outputs as two
    separate ``DynamicCache``s run through transformers' own attention: prefill, then 3 steps."""
    ids = janus.sample_inputs(PROMPT)["input_ids"]
    embeds = walks.prompt_embedder(ids)  # [1, 2, T, D]
    steps = [walks.image_embedder(torch.tensor([[t]])) for t in (5, 17, 200)]  # [1, 2, 1, D]
    handles = walks.kv_open(ids)
    try:
        got = [walks.lm(handles, e) for e in [embeds, *steps]]  # [1, 2, D] each
        rid = walks.kv.request_id(int(handles[0]))
        assert walks.kv.pool.labels(rid) == ["cond", "uncond"]
    finally:
        walks.kv_release(handles, ids)
    lm = ref.model.language_model
    for label in range(2):
        cache = transformers.DynamicCache(config=lm.config)
        for i, e in enumerate([embeds, *steps]):
            with torch.no_grad():
                out = lm(inputs_embeds=e[:, label], cache=cache, use_cache=True)
            want = out.last_hidden_state[:, -1]  # [1, D]
            torch.testing.assert_close(got[i][:, label], want, atol=1e-5, rtol=1e-5)
    assert walks.kv.pool.pages_in_use == 0


def test_understanding_tokens_equal_upstream_text_generate(ref, walks) -> None:
    """Image understanding: the prompt with its image features scattered into the
    placeholders, one "text" label in the same pool, greedy: upstream ``generate`` in text
    mode with ``pixel_values``, token for token."""
    for prompt in [(40, 50, 60), (7, 8)]:
        u = janus.understand_inputs(prompt, max_new_tokens=12)
        ids, pixels = u["text_ids"], u["pixel_values"]
        with torch.no_grad():
            want = ref.generate(
                ids,
                pixel_values=pixels,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=12,
            )[:, ids.shape[1] :]
            got = walks.understand(ids, pixels, 12)["tokens"]
        assert torch.equal(got, want), (got, want)
        assert len(set(want[0].tolist())) > 3  # varied output, not one repeated token
    assert walks.kv.pool.pages_in_use == 0


def test_load_janus_from_a_checkpoint_directory(ref, tmp_path) -> None:
    """``save_pretrained`` of the tiny model, loaded back: the same image tokens as upstream
    for the same seed; a generation config without BOI is refused, saying what is missing."""
    model = janus.tiny_janus(0)
    model.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="boi_token_id"):
        janus.load_janus(str(tmp_path / "bare"))
    model.generation_config = transformers.GenerationConfig(  # as a Janus checkpoint ships it
        bos_token_id=janus.TINY_IDS.bos,
        pad_token_id=janus.TINY_IDS.pad,
        generation_kwargs={"boi_token_id": janus.TINY_IDS.boi},
    )
    model.save_pretrained(tmp_path / "full")
    walks, sample = janus.load_janus(str(tmp_path / "full"))
    ids = janus.sample_inputs(PROMPT)["input_ids"]
    with torch.no_grad():
        got = walks.generate(ids, torch.tensor([9]))["image_tokens"]
    assert torch.equal(got, upstream_tokens(ref, ids, 9, janus.ImageSampling()))
    assert sample["input_ids"].tolist() == [[janus.TINY_IDS.bos, janus.TINY_IDS.boi]]
    assert set(capture.trace(walks, sample).graph.walks) == {
        "generate",
        "understand",
        "chat",
        "chat_image",
        "pool_usage",
    }


def test_bad_sampling_values_are_refused() -> None:
    with pytest.raises(ValueError, match="guidance_scale"):
        janus.ImageSampling(guidance_scale=1.0)
    with pytest.raises(ValueError, match="top_p"):
        janus.ImageSampling(top_p=0.0)


def test_factory_profiles_come_from_the_module_hook() -> None:
    from walkserve.adapters.registry import profile_for
    from walkserve.api.profile import ModelProfile

    profile = profile_for("walkserve.adapters.janus:tiny")
    assert profile.image is not None and profile.image.noise_input is None
    assert profile.image.encode("hi") == [janus.TINY_IDS.bos, 107, 108, janus.TINY_IDS.boi]
    plain = "walkserve.adapters.examples.text:build"  # no api_profile: walks only
    assert profile_for(plain) == ModelProfile(plain)
    # an unknown module: no tasks here (serving it fails later, saying why)
    assert profile_for("walkserve.adapters.no_such_module:tiny").image is None


def test_repeated_prompts_reuse_cached_context_pages(ref) -> None:
    """Pages of 4 tokens: a second request with the first one's prompt (another seed) reuses its
    cached prompt pages in both guidance contexts, and a third with another prompt of the same
    length reuses the unconditioned context's (all PAD but BOS and BOI); every request's tokens
    are still upstream's."""
    walks = janus.JanusImageWalks(
        janus.tiny_janus(0), janus.TINY_IDS, pool=janus.PoolSize(num_pages=64, page_size=4)
    )
    prompt = tuple(range(40, 51))  # 11 ids + BOS + BOI = 13 tokens: 3 full pages
    other = tuple(range(60, 71))
    hits = []
    for p, seed in ((prompt, 1), (prompt, 2), (other, 3)):
        ids = janus.sample_inputs(p)["input_ids"]
        with torch.no_grad():
            out = walks.generate(ids, torch.tensor([seed]))
        assert torch.equal(
            out["image_tokens"], upstream_tokens(ref, ids, seed, janus.ImageSampling())
        )
        hits.append(walks.kv.pool.stats().prefix_hits)
    assert hits == [0, 2 * 3, 2 * 3 + 3]  # both contexts, then the unconditioned one only
    assert walks.kv.pool.pages_in_use == 0 and walks.kv.pool.stats().sequences == 0


def test_chat_with_an_image_equals_upstream_text_generate(ref, walks) -> None:
    """The profile's chat media inputs for an image (upstream's Janus image processor, BOI,
    ``num_image_tokens`` placeholders, EOI as ``JanusProcessor`` expands them), spliced into
    the rendered chat prompt: ``chat_image`` gives upstream ``generate()``'s greedy text; a
    text-only chat through ``chat`` likewise."""
    import numpy as np
    from transformers import JanusImageProcessorPil

    from walkserve.adapters.registry import profile_for

    profile = profile_for("walkserve.adapters.janus:tiny")
    assert profile.text is not None and profile.chat_media is not None
    media = profile.chat_media.image
    assert media is not None and media.walk == "chat_image"
    text = profile.text
    image = np.random.RandomState(3).randint(0, 256, (40, 30, 3), dtype=np.uint8)
    found, placeholders = media.inputs([torch.from_numpy(image)])
    upstream = JanusImageProcessorPil(size={"height": 64, "width": 64})
    pixels = upstream(images=[image], input_data_format="channels_last", return_tensors="pt")
    assert torch.equal(found["pixel_values"], pixels["pixel_values"])
    n = ref.config.vision_config.num_image_tokens
    assert placeholders == [[janus.TINY_IDS.boi, *[janus.TINY_IMAGE_TOKEN] * n, janus.TINY_EOI]]
    ids = torch.tensor(
        [[*text.encode("user: "), *placeholders[0], *text.encode("what is it?\nassistant:")]]
    )
    with torch.no_grad():
        want = ref.generate(
            ids,
            pixel_values=pixels["pixel_values"],
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=10,
        )[:, ids.shape[1] :]
        got = walks.chat_image(ids, found["pixel_values"], 10)["tokens"]
    assert torch.equal(got, want), (got, want)
    plain = torch.tensor([text.encode(text.chat_template([("user", "hello")]))])
    with torch.no_grad():
        want = ref.generate(
            plain, attention_mask=torch.ones_like(plain), do_sample=False, max_new_tokens=10
        )[:, plain.shape[1] :]
        got = walks.chat(plain, 10)["tokens"]
    assert torch.equal(got, want), (got, want)
    assert walks.kv.pool.pages_in_use == 0


def test_chat_with_two_images_equals_upstream_text_generate(ref, walks) -> None:
    """Two images in one prompt: their pixel values in part order and two placeholder runs;
    upstream scatters both images' features, in order, and so does ``chat_image``."""
    import numpy as np

    from walkserve.adapters.registry import profile_for

    profile = profile_for("walkserve.adapters.janus:tiny")
    assert profile.text is not None and profile.chat_media is not None
    assert profile.chat_media.image is not None and profile.chat_media.max_parts > 1
    images = [np.random.RandomState(s).randint(0, 256, (40, 30, 3), dtype=np.uint8) for s in (1, 2)]
    found, ph = profile.chat_media.image.inputs([torch.from_numpy(i) for i in images])
    assert found["pixel_values"].shape[0] == 2
    enc = profile.text.encode
    ids = torch.tensor([[*enc("user: "), *ph[0], *enc(" and "), *ph[1], *enc("?\nassistant:")]])
    with torch.no_grad():
        want = ref.generate(
            ids,
            pixel_values=found["pixel_values"],
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=10,
        )[:, ids.shape[1] :]
        got = walks.chat_image(ids, found["pixel_values"], 10)["tokens"]
        swapped = walks.chat_image(ids, found["pixel_values"].flip(0), 10)["tokens"]
    assert torch.equal(got, want), (got, want)
    assert not torch.equal(swapped, want)  # both images count, in order
    assert walks.kv.pool.pages_in_use == 0
