"""Eager tests of the built-in example models (``walkserve.adapters.examples``).

No capture and no runtime: each walk runs as the plain PyTorch it is. The tests check what the
captured graphs will later be compared against: builders are deterministic in their seed, every
walk produces the documented shapes and dtypes, loops stop where they should, and the streamed,
cached computations equal their one-shot counterparts (a chunked codec decode equals a manual
loop over the LeftContext chunks and a whole-sequence decode; a KV-cached decode equals a full
recompute; a step-by-step rollout equals one block-causal pass).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from walkserve.adapters.examples import EXAMPLES, build_example, cfg_image, speech, text, world
from walkserve.adapters.examples.blocks import empty_kv
from walkserve.capture.api import stream, walk_specs
from walkserve.capture.chunk import LeftContext

NAMES = ["example-cfg-image", "example-speech", "example-world", "example-text"]


def run_request(model: nn.Module, inputs: dict[str, Any], first: str) -> dict[str, Tensor]:
    """Run walk ``first`` and the walks its ``next`` chain names; each walk takes its arguments
    by name from the request inputs and the earlier walks' outputs. Returns all outputs."""
    specs = walk_specs(model)
    available = dict(inputs)
    outputs: dict[str, Tensor] = {}
    name: str | None = first
    while name is not None:
        attr, spec = specs[name]
        method = getattr(model, attr)
        params = inspect.signature(method).parameters
        out = method(**{p: available[p] for p in params})
        available.update(out)
        outputs.update(out)
        name = spec.next
    return outputs


def run_all(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Tensor]:
    """Every request a model serves: one per walk that no other walk leads to."""
    specs = walk_specs(model)
    followers = {spec.next for _, spec in specs.values()}
    results: dict[str, Tensor] = {}
    for name in specs:
        if name not in followers:
            out = run_request(model, inputs, name)
            results.update({f"{name}.{key}": value for key, value in out.items()})
    return results


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert list(EXAMPLES) == NAMES


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="example-speech") as info:
        build_example("example-nope")
    for name in NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_builder_is_deterministic_in_its_seed(name: str) -> None:
    model_a, inputs_a = build_example(name, seed=0)
    model_b, inputs_b = build_example(name, seed=0)
    model_c, inputs_c = EXAMPLES[name](1)
    assert_same(model_a.state_dict(), model_b.state_dict())
    assert_same(inputs_a, inputs_b)
    assert inputs_a.keys() == inputs_c.keys()
    assert not all(
        torch.equal(p, q) for p, q in zip(model_a.parameters(), model_c.parameters(), strict=True)
    )
    out_a, out_b, out_c = (
        run_all(model_a, inputs_a),
        run_all(model_b, inputs_b),
        run_all(model_c, inputs_c),
    )
    assert_same(out_a, out_b)
    assert any(
        out_a[k].shape != out_c[k].shape or not torch.equal(out_a[k], out_c[k]) for k in out_a
    )


@pytest.mark.parametrize("name", NAMES)
def test_builder_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_example(name)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", NAMES)
def test_model_is_frozen_for_serving(name: str) -> None:
    model, _ = build_example(name)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


# ------------------------------------------------------------------------------- cfg image


def test_cfg_image_walks() -> None:
    model, inputs = cfg_image.build()
    assert model.sigmas.shape == (cfg_image.NUM_GRID_POINTS,) == (20,)
    assert model.sigmas[0] == 1.0 and model.sigmas[-1] == 0.0
    calls = []
    model.denoiser.register_forward_hook(lambda *_: calls.append(1))

    generated = model.generate(inputs["prompt_ids"], inputs["noise"])
    assert len(calls) == 3 * cfg_image.NUM_EULER_UPDATES == 3 * 19
    edited = model.edit(inputs["prompt_ids"], inputs["image"], inputs["noise"])
    assert len(calls) == 2 * 3 * 19

    for out in (generated, edited):
        assert list(out) == ["image"]
        image = out["image"]
        assert image.shape == (1, 3, 16, 16) and image.dtype == torch.float32
        assert image.isfinite().all() and image.abs().max() <= 1.0
    assert not torch.allclose(generated["image"], edited["image"])
    other_image = model.edit(inputs["prompt_ids"], -inputs["image"], inputs["noise"])["image"]
    assert not torch.allclose(other_image, edited["image"])
    other_prompt = model.generate(inputs["prompt_ids"].flip(1), inputs["noise"])["image"]
    assert not torch.allclose(other_prompt, generated["image"])


def test_cfg_euler_step_combines_three_branches() -> None:
    model, inputs = cfg_image.build()
    z = inputs["noise"]
    text_ctx = model.text_encoder(inputs["prompt_ids"])
    null_text = model.text_encoder(torch.zeros_like(inputs["prompt_ids"]))
    img_ctx = model.image_encoder(inputs["image"])
    null_img = model.no_image
    t, t_next = model.sigmas[3], model.sigmas[4]
    v_txt = model.denoiser(z, t, text_ctx, img_ctx)
    v_img = model.denoiser(z, t, null_text, img_ctx)
    v_unc = model.denoiser(z, t, null_text, null_img)
    v = (
        v_unc
        + cfg_image.IMAGE_GUIDANCE * (v_img - v_unc)
        + cfg_image.TEXT_GUIDANCE * (v_txt - v_img)
    )
    step = model.euler_step(z, t, t_next, text_ctx, img_ctx, null_text, null_img)
    torch.testing.assert_close(step, z + (t_next - t) * v)
    # A batched time [B] gives the same velocity as a scalar time.
    torch.testing.assert_close(model.denoiser(z, t.reshape(1), text_ctx, img_ctx), v_txt)


# ---------------------------------------------------------------------------------- speech


def test_speech_walk_shapes_and_early_stop() -> None:
    model, inputs = speech.build()
    out = model.speak(**inputs)
    assert list(out) == ["text_tokens", "codes", "waveform"]
    text_tokens, codes, waveform = out["text_tokens"], out["codes"], out["waveform"]
    steps = codes.shape[1]
    assert text_tokens.dtype == codes.dtype == torch.int64 and waveform.dtype == torch.float32
    assert text_tokens.shape == (1, steps + 1)
    assert waveform.shape == (1, steps * speech.HOP)
    assert codes.min() >= 0 and codes.max() < speech.CODEBOOK
    assert waveform.isfinite().all()
    # The thinker stopped at EOS after a few steps, well before max_new_tokens.
    assert text_tokens[0, -1] == model.eos_id
    assert model.eos_id not in text_tokens[0, 1:-1].tolist()
    assert 3 <= steps <= 12 < inputs["max_new_tokens"]


def test_speech_thinker_runs_to_max_without_eos() -> None:
    model, inputs = speech.build()
    model.eos_id = -1  # never emitted
    out = model.speak(inputs["prompt_ids"], 9)
    assert out["text_tokens"].shape == (1, 10)
    assert out["codes"].shape == (1, 9)
    assert out["waveform"].shape == (1, 9 * speech.HOP)


def manual_codec(model: speech.SpeechModel, codes: Tensor) -> Tensor:
    """LeftContext(L, C) decoding written out by hand: chunk i holds new frames
    [i*C, (i+1)*C) after up to L context frames; the context's samples are dropped."""
    ctx, size, hop = speech.CODEC_CONTEXT, speech.CODEC_CHUNK, speech.HOP
    n = codes.shape[1]
    pieces = []
    for i in range(math.ceil(n / size)):
        new_start = i * size
        start = max(0, new_start - ctx)
        wav = model.codec(codes[:, start : min(new_start + size, n)])
        pieces.append(wav[..., (new_start - start) * hop :])
    return torch.cat(pieces, dim=-1)


def test_speech_streamed_codec_equals_manual_chunk_loop() -> None:
    model, inputs = speech.build()
    out = model.speak(**inputs)
    assert torch.equal(out["waveform"], manual_codec(model, out["codes"]))
    # The codec is causal with a receptive field of CODEC_CONTEXT + 1 frames, so the chunked
    # decode also matches one decode of the whole sequence.
    torch.testing.assert_close(out["waveform"], model.codec(out["codes"]))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 11])
def test_speech_chunk_loop_on_longer_code_sequences(n: int) -> None:
    model, _ = speech.build()
    codes = torch.randint(0, speech.CODEBOOK, (2, n), generator=torch.Generator().manual_seed(n))
    policy = LeftContext(speech.CODEC_CONTEXT, speech.CODEC_CHUNK)
    streamed = torch.cat(
        [model.decode_chunk(chunk, n_ctx) for chunk, n_ctx in stream(codes, policy, dim=1)], dim=-1
    )
    assert streamed.shape == (2, n * speech.HOP)
    assert torch.equal(streamed, manual_codec(model, codes))
    torch.testing.assert_close(streamed, model.codec(codes))


def test_speech_stepwise_talker_equals_teacher_forced_pass() -> None:
    model, inputs = speech.build()
    prompt = inputs["prompt_ids"]
    out = model.speak(**inputs)
    text_tokens, codes = out["text_tokens"], out["codes"]
    # Thinker hidden states of the text tokens it read, t0 .. t{n-1}, in one cached pass.
    k, v = empty_kv(model.thinker_cfg, prompt)
    _, _, k, v = model.thinker(prompt, k, v)
    _, hidden, _, _ = model.thinker(text_tokens[:, :-1], k, v)
    # The talker over all of them at once, fed its own previous codes, picks the same codes.
    prev = torch.cat([torch.full_like(codes[:, :1], speech.CODEC_BOS), codes[:, :-1]], dim=1)
    tk, tv = empty_kv(model.talker_cfg, prompt)
    logits, _, _ = model.talker(hidden, prev, tk, tv)
    assert torch.equal(logits.argmax(-1), codes)


# ----------------------------------------------------------------------------------- world


def test_world_rollout_shapes() -> None:
    model, inputs = world.build()
    out = model.rollout(**inputs)
    assert list(out) == ["predicted"]
    predicted = out["predicted"]
    d = world.PREDICTOR_CONFIG.dim
    assert predicted.shape == (1, inputs["horizon"], world.TOKENS_PER_FRAME, d)
    assert predicted.dtype == torch.float32 and predicted.isfinite().all()
    assert not torch.allclose(predicted[:, 0], predicted[:, 1])
    shorter = model.rollout(inputs["frames"], inputs["actions"], 2)["predicted"]
    assert torch.equal(shorter, predicted[:, :2])


def test_world_rollout_depends_on_actions() -> None:
    model, inputs = world.build()
    base = model.rollout(**inputs)["predicted"]
    other = (inputs["actions"] + 1) % world.NUM_ACTIONS
    assert not torch.allclose(
        model.rollout(inputs["frames"], other, inputs["horizon"])["predicted"], base
    )


def test_world_rollout_stops_when_episode_ends() -> None:
    model, inputs = world.build()
    nn.init.constant_(model.predictor.end_head.bias, 4.0)  # every step predicts the end
    predicted = model.rollout(**inputs)["predicted"]
    assert predicted.shape[1] == 1 < inputs["horizon"]


def test_world_stepwise_rollout_equals_one_block_causal_pass() -> None:
    model, inputs = world.build()
    frames, actions, horizon = inputs["frames"], inputs["actions"], inputs["horizon"]
    predicted = model.rollout(**inputs)["predicted"]  # [B, h, N, D]
    tokens = model.encoder(frames)  # [B, F, N, D]
    # Blocks: history frames (no action), the last context frame and all but the last
    # prediction, with their actions; one pass with an empty cache.
    blocks = torch.cat([tokens, predicted[:, :-1]], dim=1)
    history = tokens.shape[1] - 1
    acts = torch.cat([torch.full((1, history), world.NO_ACTION), actions[:, :horizon]], dim=1)
    k, v = empty_kv(model.cfg, frames)
    next_tokens, _, new_k, _ = model.predictor(blocks, acts, k, v)
    torch.testing.assert_close(next_tokens[:, history:], predicted)
    assert new_k.shape[3] == blocks.shape[1] * (world.TOKENS_PER_FRAME + 1)


def test_world_single_context_frame() -> None:
    model, inputs = world.build()
    out = model.rollout(inputs["frames"][:, -1:], inputs["actions"], 3)["predicted"]
    assert out.shape == (1, 3, world.TOKENS_PER_FRAME, world.PREDICTOR_CONFIG.dim)


# ------------------------------------------------------------------------------------ text


def test_text_prefill_outputs() -> None:
    model, inputs = text.build()
    prompt = inputs["prompt_ids"]
    out = model.prefill(prompt)
    assert list(out) == ["token", "k_cache", "v_cache", "position"]
    cfg = text.LM_CONFIG
    assert out["token"].shape == (1, 1) and out["token"].dtype == torch.int64
    assert (
        out["k_cache"].shape
        == out["v_cache"].shape
        == (cfg.layers, 1, cfg.heads, prompt.shape[1], cfg.head_dim)
    )
    assert out["position"].tolist() == [prompt.shape[1]]


def test_text_decode_runs_to_max_new_tokens_and_varies() -> None:
    model, inputs = text.build()
    model.eos_id = -1  # never emitted
    out = run_request(model, inputs, "prefill")
    tokens = out["tokens"]
    assert tokens.shape == (1, inputs["max_new_tokens"]) and tokens.dtype == torch.int64
    assert len(set(tokens[0].tolist())) >= 4  # greedy output is not one repeated token


def test_text_decode_stops_at_eos() -> None:
    model, inputs = text.build()
    model.eos_id = -1
    free = run_request(model, inputs, "prefill")["tokens"][0].tolist()
    step = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    model.eos_id = free[step]
    stopped = run_request(model, inputs, "prefill")["tokens"][0].tolist()
    assert stopped == free[: step + 1]  # EOS included, nothing after it


def test_text_cached_decode_equals_full_recompute() -> None:
    model, inputs = text.build()
    prompt = inputs["prompt_ids"]
    first = model.prefill(prompt)["token"]
    tokens = run_request(model, inputs, "prefill")["tokens"]
    sequence = torch.cat([prompt, first, tokens], dim=1)
    k, v = empty_kv(model.cfg, prompt)
    logits, _, _ = model.lm(sequence[:, :-1], k, v)  # no cache: every position at once
    greedy = logits[:, prompt.shape[1] - 1 :].argmax(-1)
    assert torch.equal(greedy, sequence[:, prompt.shape[1] :])
