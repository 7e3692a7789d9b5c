"""walkserve-default: the built-in model the HTTP server serves when none is named. One
``nn.Module`` offering text, speech and image walks, composed from the example components:

    walk                                       task     built from
    prefill(prompt_ids) -> decode(...)         text     a byte-vocabulary ``TextLM`` (text.py)
    speak(prompt_ids, max_new_tokens)          speech   ``SpeechModel`` (speech.py), as built
    generate(prompt_ids, noise)                image    ``CFGImageModel`` (cfg_image.py), as built
    edit(prompt_ids, image, noise)             image    ``CFGImageModel.edit``: guided by ``image``

Text: ``prefill`` runs the prompt through the LM and keeps the last position's logits as request
state; every generated token comes out of ``decode``'s DynamicLoop, so each one is a
``StreamItem`` of channel ``tokens`` (the first included):

    prefill   p0 p1 ... p{P-1}  -> logits of position P-1           (state: logits, k/v cache)
    decode    step i: t_i = argmax(logits); logits = LM(t_i)        tokens = [t0, t1, ...]
              stops after the step that emits EOS or after max_new_tokens steps

Vocabularies differ per task (``TEXT_VOCAB`` covers every byte after the special ids; speech and
image prompts use their example's 64-id vocabulary): ``adapters.tokenizer.ByteTokenizer`` maps
text to each. The weights are random (seeded), so outputs are deterministic noise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.examples import cfg_image, speech
from walkserve.adapters.examples.blocks import StackConfig, empty_kv, init_weights, seeded
from walkserve.adapters.examples.text import INIT_STD, TextLM
from walkserve.capture.api import iterations, loop, walk

NAME = "walkserve-default"
SPECIAL_IDS = 3  # 0 pad, 1 bos, 2 eos
EOS_ID = 2
TEXT_VOCAB = SPECIAL_IDS + 256  # every byte has its own id
TEXT_CONFIG = StackConfig(dim=48, layers=2, heads=4)
SPEECH_VOCAB = speech.THINKER_VOCAB
IMAGE_VOCAB = cfg_image.VOCAB
IMAGE_SIZE = cfg_image.IMAGE_SIZE
NOISE_SHAPE = (cfg_image.LATENT_CHANNELS, cfg_image.LATENT_SIZE, cfg_image.LATENT_SIZE)
HOP = speech.HOP  # waveform samples per codec frame
SAMPLE_RATE = 16000  # nominal: the waveform is random-weight noise at any rate
MAX_NEW_TOKENS = 16


class DefaultModel(nn.Module):
    """Text (``prefill`` -> ``decode``), speech (``speak``) and image (``generate``, ``edit``)
    walks."""

    def __init__(self, speech_model: speech.SpeechModel, image_model: cfg_image.CFGImageModel):
        super().__init__()
        self.text_cfg = TEXT_CONFIG
        self.eos_id = EOS_ID
        self.lm = TextLM(TEXT_VOCAB, TEXT_CONFIG)
        self.speech = speech_model
        self.image = image_model

    # ---------------------------------------------------------------- text

    @walk(next="decode", state=("logits", "k_cache", "v_cache"))
    def prefill(self, prompt_ids: Tensor) -> dict[str, Tensor]:
        # prompt_ids: [B, P] int64, ids < TEXT_VOCAB
        k_cache, v_cache = empty_kv(self.text_cfg, prompt_ids)  # [layers, B, H, 0, hd]
        logits, k_cache, v_cache = self.lm(prompt_ids, k_cache, v_cache)  # [B, P, V]
        return {"logits": logits[:, -1], "k_cache": k_cache, "v_cache": v_cache}  # [B, V]

    @walk
    def decode(
        self, logits: Tensor, k_cache: Tensor, v_cache: Tensor, max_new_tokens: int
    ) -> dict[str, Tensor]:
        tokens: list[Tensor] = []
        for _ in iterations(max_new_tokens):
            k_cache, v_cache, logits, token, done = self.decode_step(k_cache, v_cache, logits)
            tokens.append(token)
            if done:
                break
        return {"tokens": torch.cat(tokens, dim=1)}  # [B, n], n <= max_new_tokens

    @loop(max_iters="max_new_tokens")
    def decode_step(
        self, k_cache: Tensor, v_cache: Tensor, logits: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # logits: [B, V] of the previous position
        token = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
        step_logits, k_cache, v_cache = self.lm(token, k_cache, v_cache)  # [B, 1, V]
        done = (token == self.eos_id).all()  # 0-d bool
        return k_cache, v_cache, step_logits[:, -1], token, done

    # ---------------------------------------------------------------- speech

    @walk
    def speak(self, prompt_ids: Tensor, max_new_tokens: int) -> dict[str, Tensor]:
        # prompt_ids: [B, P] int64, ids < SPEECH_VOCAB
        return self.speech.speak(prompt_ids, max_new_tokens)  # text_tokens, codes, waveform

    # ---------------------------------------------------------------- image

    @walk
    def generate(self, prompt_ids: Tensor, noise: Tensor) -> dict[str, Tensor]:
        # prompt_ids: [B, T] int64, ids < IMAGE_VOCAB; noise: [B, C, 8, 8]
        return self.image.generate(prompt_ids, noise)  # image [B, 3, 16, 16] in [-1, 1]

    @walk
    def edit(self, prompt_ids: Tensor, image: Tensor, noise: Tensor) -> dict[str, Tensor]:
        # prompt_ids: [B, T] int64, ids < IMAGE_VOCAB; image: [B, 3, 16, 16] in [-1, 1];
        # noise: [B, C, 8, 8]
        return self.image.edit(prompt_ids, image, noise)  # image [B, 3, 16, 16] in [-1, 1]


def build(seed: int = 0) -> tuple[DefaultModel, dict[str, Any]]:
    """The model with seeded random weights (the speech and image parts exactly as their
    examples build them with ``seed``), and the inputs of a sample request for every walk."""
    speech_model, speech_inputs = speech.build(seed)
    image_model, image_inputs = cfg_image.build(seed)
    with seeded(seed):
        model = DefaultModel(speech_model, image_model)
        init_weights(model.lm, INIT_STD)
    model.eval().requires_grad_(False)
    return model, {
        "prompt_ids": speech_inputs["prompt_ids"],  # ids < 64: valid for every walk
        "max_new_tokens": MAX_NEW_TOKENS,
        "noise": image_inputs["noise"],
        "image": image_inputs["image"],
    }
