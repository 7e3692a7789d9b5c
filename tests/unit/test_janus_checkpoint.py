"""The chat profile of a Janus checkpoint directory (``janus.checkpoint``): its prompts and
image inputs are what the checkpoint's ``JanusProcessor`` makes of the same messages and image;
a processor that disagrees with the model is refused, a directory without one is served through
its walks only, and text that holds the image placeholder is a 400. Its image generation
prompts and pixels are the processor's too, and the walks sample as its generation config says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from PIL import Image

from walkserve.adapters.janus.checkpoint import save_tiny
from walkserve.adapters.registry import profile_for
from walkserve.api.chatmedia import MARK
from walkserve.api.errors import ApiError


def test_prompt_and_image_inputs_are_the_processors(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    save_tiny(str(tmp_path))
    profile = profile_for(str(tmp_path))
    assert profile.text is not None and profile.chat_media is not None
    media = profile.chat_media.image
    assert media is not None and media.walk == "chat_image"
    processor = AutoProcessor.from_pretrained(str(tmp_path), local_files_only=True)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (20, 30, 3), dtype=np.uint8))
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Why?"}]}]
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    want = processor(text=text, images=[image], return_tensors="pt")

    mark = MARK.format(0)
    rendered = profile.text.chat_template([("user", mark + "Why?")])
    before, after = rendered.split(mark)
    inputs, [placeholders] = media.inputs([torch.from_numpy(np.array(image))])
    ids = [*profile.text.encode(before), *placeholders, *profile.text.encode(after)]
    assert ids == want["input_ids"][0].tolist()
    assert torch.equal(inputs["pixel_values"], want["pixel_values"])

    with pytest.raises(ApiError, match="image_placeholder"):
        profile.text.chat_template([("user", "<image_placeholder> as text")])


def test_a_processor_that_disagrees_is_refused_and_none_means_walks_only(
    tmp_path: Path,
) -> None:
    save_tiny(str(tmp_path))
    config = tmp_path / "processor_config.json"
    body = json.loads(config.read_text())
    body["num_image_tokens"] = 9
    config.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="9 tokens, the vision tower makes 16"):
        profile_for(str(tmp_path))
    config.unlink()
    (tmp_path / "tokenizer.json").unlink()
    profile = profile_for(str(tmp_path))
    assert profile.text is None and profile.chat_media is None


def test_image_generation_prompt_pixels_and_sampling_are_the_checkpoints(tmp_path: Path) -> None:
    """The image task's prompt ids are the processor's for ``generation_mode="image"`` (chat
    template, BOI last); its pixels are the processor's ``postprocess``; the walks sample with
    the generation config's guidance and top-k; the image specials in a prompt are a 400; a
    processor whose postprocess makes no 8-bit images serves no image generation."""
    from transformers import AutoProcessor

    from walkserve.adapters.janus import ImageSampling, load_janus

    save_tiny(str(tmp_path), guidance_scale=3.0, do_sample=True, top_k=20)
    task = profile_for(str(tmp_path)).image
    assert task is not None and task.walk == "generate" and task.size == 64
    processor = AutoProcessor.from_pretrained(str(tmp_path), local_files_only=True)
    hf = [{"role": "user", "content": [{"type": "text", "text": "a cat"}]}]
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    want = processor(text=text, generation_mode="image", return_tensors="pt")["input_ids"][0]
    assert task.encode("a cat") == want.tolist() and want[-1] == 301 and want[0] == 1
    image = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2.4 - 1.2
    assert task.pixels is not None
    post = processor.postprocess([image], return_tensors="PIL.Image.Image")["pixel_values"][0]
    assert torch.equal(task.pixels(image), torch.from_numpy(np.array(post)))
    for special in ("<image_placeholder>", "<begin_of_image>", "<end_of_image>"):
        with pytest.raises(ApiError, match=special):
            task.encode(f"a {special} b")
    walks, _ = load_janus(str(tmp_path))
    assert walks.sampler.sampling == ImageSampling(guidance_scale=3.0, top_k=20)

    config = tmp_path / "processor_config.json"
    body = json.loads(config.read_text())
    body["image_processor"]["do_normalize"] = False
    config.write_text(json.dumps(body))
    assert profile_for(str(tmp_path)).image is None
