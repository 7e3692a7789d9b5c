"""The SD3 walks (``walkserve.adapters.diffusers_dit``) against diffusers' own
``StableDiffusion3Pipeline`` on tiny random parts built in code, in process (no workers).

Tolerance of walk vs pipeline: ``max|walk - pipeline| <= 2e-5`` on images in [0, 1]. The
pipeline runs the two guidance branches as ONE transformer call on a batch of 2
(``torch.cat([latents] * 2)``); the walk runs them as two batch-1 calls (they are separate graph
nodes so that they can run on two ranks). float32 matmuls of batch 2 and batch 1 sum in another
order (~1e-7 relative per call); guidance (scale up to 7.5) and the Euler steps carry it along.
Measured on these configs: ~1e-6. A different seed, step count or prompt moves the image by
> 1e-2, so the bound separates right from wrong by three orders of magnitude (checked below).
Everything else (schedule, initial latents, the guidance combine, the Euler step, latent
unscaling, decode, [0, 1] mapping) is the same float32 arithmetic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import diffusers_dit as D
from walkserve.adapters.diffusers_tiny import tiny_pipeline
from walkserve.adapters.diffusers_upstream import pipeline_edit_image, pipeline_image
from walkserve.adapters.registry import profile_for
from walkserve.capture import ir
from walkserve.capture.sections import parallel_groups

TOLERANCE = 2e-5  # see the module docstring

CASES = [  # prompt, negative prompt, seed, steps, guidance scale, size
    ("a red square", "", 0, 2, 5.0, None),
    ("blue circle on grass", "blurry", 7, 3, 7.5, None),
    ("x", "", 3, 1, 2.0, 16),  # a smaller size than the native 32
]


@pytest.fixture(scope="module")
def tiny() -> tuple[D.SD3Walks, dict[str, Any], capture.CapturedModel]:
    walks, sample = D.tiny()
    return walks, sample, capture.trace(walks, sample)


@pytest.mark.parametrize(("prompt", "negative", "seed", "steps", "guidance", "size"), CASES)
def test_walk_image_equals_the_pipeline(
    tiny: Any, prompt: str, negative: str, seed: int, steps: int, guidance: float, size: Any
) -> None:
    walks, _, captured = tiny
    kw = dict(negative_prompt=negative, seed=seed, steps=steps, guidance_scale=guidance, size=size)
    inputs = D.request_inputs(walks, prompt, **kw)
    got = captured.run(inputs, walk="generate")["image"]  # the reference interpreter
    want = pipeline_image(walks, inputs, prompt, **kw)
    assert got.shape == want.shape == (1, 3, size or 32, size or 32)
    assert got.min() >= 0 and got.max() <= 1
    error = (got - want).abs().max().item()
    assert error <= TOLERANCE, error
    # The captured graph computes exactly what the decorated eager code computes.
    assert torch.equal(got, walks.generate(**inputs)["image"])


EDIT_CASES = [  # seed, steps, strength, guidance scale
    (0, 4, 0.6, 5.0),
    (3, 5, 1.0, 7.0),
    (2, 3, 0.3, 3.0),  # one step left
]


@pytest.mark.parametrize(("seed", "steps", "strength", "guidance"), EDIT_CASES)
def test_edit_walk_equals_the_img2img_pipeline(
    tiny: Any, seed: int, steps: int, strength: float, guidance: float
) -> None:
    """``edit`` against ``StableDiffusion3Img2ImgPipeline`` on the same parts (same tolerance
    and reason as above)."""
    walks, _, captured = tiny
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))  # [0, 1]
    kw = dict(seed=seed, steps=steps, strength=strength, guidance_scale=guidance)
    inputs = D.edit_inputs(walks, "make it blue", image, **kw)
    got = captured.run(inputs, walk="edit")["image"]
    want = pipeline_edit_image(walks, "make it blue", image, **kw)
    error = (got - want).abs().max().item()
    assert error <= TOLERANCE, error
    assert torch.equal(got, walks.edit(**inputs)["image"])
    other = captured.run({**inputs, "image": inputs["image"].flip(-1)}, walk="edit")["image"]
    if strength < 1.0:  # at strength 1 the input image only enters through weak latents
        assert (other - want).abs().max().item() > 100 * TOLERANCE


def test_the_tolerance_separates_right_from_wrong(tiny: Any) -> None:
    walks, _, captured = tiny
    base = D.request_inputs(walks, "a red square", seed=0, steps=2)
    want = pipeline_image(walks, base, "a red square", seed=0, steps=2)
    for change in (
        dict(seed=1, steps=2),
        dict(seed=0, steps=3),
        dict(seed=0, steps=2, guidance_scale=3.0),
    ):
        other = captured.run(D.request_inputs(walks, "a red square", **change), walk="generate")
        assert (other["image"] - want).abs().max().item() > 100 * TOLERANCE, change
    other = captured.run(D.request_inputs(walks, "a blue square", seed=0, steps=2), walk="generate")
    assert (other["image"] - want).abs().max().item() > 100 * TOLERANCE


def test_captured_structure(tiny: Any) -> None:
    """A Loop over the num_steps input whose body is a Parallel of the two transformer calls,
    the text encoders outside it, the VAE decoder after it."""
    _, _, captured = tiny
    (loop,) = [n for n in captured.walk("generate").body.nodes if isinstance(n, ir.LoopNode)]
    assert loop.trips == ir.InputTrips("num_steps"), loop.trips
    transformers = [
        n.name for n in loop.body.nodes if isinstance(n, ir.Op) and n.target == "transformer"
    ]
    assert len(transformers) == 2
    assert parallel_groups(loop.body) == [transformers]
    text = captured.render("generate")
    assert "loop denoise_step x num_steps (walk input)" in text
    assert (
        "per step    t = timesteps[:, i], sigma = sigmas[:, i], sigma_next = sigmas[:, 1 + i]"
        in text
    )
    for name in ("text_encoder(", "text_encoder_2(", "vae_decoder("):
        assert f"component {name}" in text, name


def test_request_inputs_match_the_pipeline_and_refuse_bad_values(tiny: Any) -> None:
    walks, _, _ = tiny
    inputs = D.request_inputs(walks, "hi", seed=5, steps=3, guidance_scale=4.0)
    pipe = walks.host.pipe
    pipe.scheduler.set_timesteps(3)
    assert torch.equal(inputs["sigmas"][0], pipe.scheduler.sigmas)
    assert torch.equal(inputs["timesteps"][0], pipe.scheduler.timesteps)
    expected = pipe.prepare_latents(
        1, 4, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(5)
    )
    assert torch.equal(inputs["latents"], expected)
    ids = inputs["prompt_ids"]
    assert ids.shape == (1, 2 * walks.shapes.ids_len) and inputs["num_steps"] == 3
    with pytest.raises(ValueError, match="guidance_scale must be > 1"):
        D.request_inputs(walks, "hi", guidance_scale=1.0)
    with pytest.raises(ValueError, match="multiple of 2"):
        D.request_inputs(walks, "hi", size=17)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        D.request_inputs(walks, "hi", steps=0)
    image = torch.rand(1, 3, 32, 32)
    assert D.edit_inputs(walks, "hi", image, steps=2, strength=0.2)["num_steps"] == 1
    with pytest.raises(ValueError, match="strength must be in"):
        D.edit_inputs(walks, "hi", image, strength=1.5)
    with pytest.raises(ValueError, match=r"image must be \[1, 3, H, W\]"):
        D.edit_inputs(walks, "hi", image[0])


def test_refuses_a_t5_encoder_and_a_stochastic_scheduler() -> None:
    pipe = tiny_pipeline()
    pipe.text_encoder_3 = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="text_encoder_3=None"):
        D.SD3Walks(pipe)
    pipe.text_encoder_3 = None
    pipe.scheduler.register_to_config(stochastic_sampling=True)
    with pytest.raises(ValueError, match="stochastic_sampling=False"):
        D.SD3Walks(pipe)


def test_loads_a_local_pipeline_directory(tiny: Any, tmp_path: Path) -> None:
    walks, _, captured = tiny
    walks.host.pipe.save_pretrained(tmp_path)
    loaded, sample = D.load_pipeline(str(tmp_path), t5_len=walks.shapes.t5_len)
    inputs = D.request_inputs(loaded, "a red square", seed=2, steps=2)
    assert torch.equal(inputs["prompt_ids"], D.request_inputs(walks, "a red square")["prompt_ids"])
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"):
        mine, theirs = getattr(walks, name).state_dict(), getattr(loaded, name).state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), name
    # Same weights; the reloaded text encoders may pick another attention kernel (not bitwise).
    got = capture.trace(loaded, sample).run(inputs, walk="generate")["image"]
    error = (got - captured.run(inputs, walk="generate")["image"]).abs().max().item()
    assert error <= TOLERANCE, error


def test_api_profile_describes_the_image_route() -> None:
    name = "walkserve.adapters.diffusers_dit:tiny"
    task = profile_for(name).image
    assert task is not None and task.walk == "generate" and task.size == 32
    assert task.noise_input == "latents" and task.noise_shape == (4, 16, 16)
    assert task.image_range == (0.0, 1.0) and task.extra_inputs is not None
    extra = task.extra_inputs("generate")
    assert extra["num_steps"] == 4 and extra["guidance_scale"].tolist() == [5.0]
    assert "latents" not in extra and "prompt_ids" not in extra
    assert task.edit_walk == "edit" and task.image_input == "image"
    assert task.edit_noise_input == "noise" and task.edit_noise_shape == (2, 4, 16, 16)
    extra = task.extra_inputs("edit")
    assert extra["num_steps"] == 3 and extra["sigmas"].shape == (1, 4)  # strength 0.6 of 4
    assert len(task.encode("hi")) == task.max_prompt_tokens == 32
    assert profile_for("walkserve.adapters.diffusers_dit:nope").image is None
    # A module:factory model whose module has no api_profile keeps the walks-only profile.
    plain = profile_for("walkserve.adapters.examples.cfg_image:build")
    assert (plain.text, plain.speech, plain.image) == (None, None, None)
