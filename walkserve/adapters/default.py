"""walkserve-default: the built-in model the HTTP server serves when none is named. One
``nn.Module`` offering text, speech and image walks:

    walk                                       task     built from
    prefill(input_ids, sampling) -> decode     text     a tiny transformers ``LlamaForCausalLM``
                                                        over the paged KV pool (``TextWalks``)
    speak(prompt_ids, max_new_tokens)          speech   ``SpeechModel`` (speech.py), as built
    generate(prompt_ids, noise)                image    ``CFGImageModel`` (cfg_image.py), as built
    edit(prompt_ids, image, noise)             image    ``CFGImageModel.edit``: guided by ``image``

Text is what any served Hugging Face causal LM does (``adapters.hf_causal_lm``): the upstream
Llama runs unmodified inside a ``PagedLM``; ``prefill`` returns the first token, ``decode``'s
DynamicLoop the rest, greedy or sampled (temperature, top-p, top-k, seed):

    prefill   p0 p1 ... p{P-1}  -> t0                               (state: paged KV, count)
    decode    step i: t_{i+1} = sample(LM(t_i))                    tokens = [t1, t2, ...]
              stops after the step that emits EOS or makes max_new_tokens tokens in all

Vocabularies differ per task (``TEXT_VOCAB`` covers every byte after the special ids; speech and
image prompts use their example's 64-id vocabulary): ``adapters.tokenizer.ByteTokenizer`` maps
text to each. The weights are random (seeded), so outputs are deterministic noise."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from walkserve.adapters.examples import cfg_image, speech
from walkserve.adapters.examples.blocks import seeded
from walkserve.adapters.hf_causal_lm import TextWalks, sample_request
from walkserve.capture.api import walk
from walkserve.runtime.kv.grammar import ByteVocabulary
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

NAME = "walkserve-default"
SPECIAL_IDS = 3  # 0 pad, 1 bos, 2 eos
EOS_ID = 2
TEXT_VOCAB = SPECIAL_IDS + 256  # every byte has its own id
TEXT_CONTEXT = 1024  # positions of the text model
TEXT_KV_TOKENS = 8192  # paged KV pool of the text model, in tokens
INIT_STD = 0.15
SPEECH_VOCAB = speech.THINKER_VOCAB
IMAGE_VOCAB = cfg_image.VOCAB
IMAGE_SIZE = cfg_image.IMAGE_SIZE
NOISE_SHAPE = (cfg_image.LATENT_CHANNELS, cfg_image.LATENT_SIZE, cfg_image.LATENT_SIZE)
HOP = speech.HOP  # waveform samples per codec frame
SAMPLE_RATE = 16000  # nominal: the waveform is random-weight noise at any rate
MAX_NEW_TOKENS = 16
MAX_PROMPT_TOKENS = 256  # of the speech and image prompts over HTTP
TEXT_PROMPT_TOKENS = 512  # of a text prompt (a chat with tools is long); TEXT_CONTEXT in all


class DefaultModel(TextWalks, nn.Module):
    """Text (``prefill`` -> ``decode``, from ``TextWalks``), speech (``speak``) and image
    (``generate``, ``edit``) walks."""

    def __init__(
        self,
        text_lm: nn.Module,
        speech_model: speech.SpeechModel,
        image_model: cfg_image.CFGImageModel,
    ) -> None:
        super().__init__()
        self.lm = PagedLM(
            text_lm,
            PagedLMConfig(pool_tokens=TEXT_KV_TOKENS),
            stop_ids=(EOS_ID,),
            vocabulary=ByteVocabulary(TEXT_VOCAB, SPECIAL_IDS, EOS_ID),
        )
        self.eos = EOS_ID
        self.speech = speech_model
        self.image = image_model

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


def text_lm(seed: int = 0) -> nn.Module:
    """The text model: a tiny random-weight transformers ``LlamaForCausalLM`` (grouped-query
    attention) over the byte vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TEXT_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TEXT_CONTEXT,
        initializer_range=INIT_STD,  # varied greedy output from random weights
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )
    with seeded(seed):
        return LlamaForCausalLM(config).eval()


def build(seed: int = 0) -> tuple[DefaultModel, dict[str, Any]]:
    """The model with seeded random weights (the speech and image parts exactly as their
    examples build them with ``seed``), and the inputs of a sample request for every walk."""
    speech_model, speech_inputs = speech.build(seed)
    image_model, image_inputs = cfg_image.build(seed)
    model = DefaultModel(text_lm(seed), speech_model, image_model)
    model.eval().requires_grad_(False)
    prompt_ids = speech_inputs["prompt_ids"]  # ids < 64: valid for every walk
    return model, {
        **sample_request(prompt_ids[0].tolist(), MAX_NEW_TOKENS),
        "prompt_ids": prompt_ids,
        "noise": image_inputs["noise"],
        "image": image_inputs["image"],
    }


def api_profile(name: str = NAME) -> Any:
    """The HTTP routes' view of the model: text, speech and image tasks over its walks, each
    with its own byte vocabulary (``ByteTokenizer``)."""
    from walkserve.adapters.hf_causal_lm import byte_text_task
    from walkserve.adapters.tokenizer import ByteTokenizer
    from walkserve.api.profile import ImageTask, ModelProfile, SpeechTask

    speech_tok = ByteTokenizer(SPEECH_VOCAB)
    image_tok = ByteTokenizer(IMAGE_VOCAB)
    return ModelProfile(
        name,
        text=byte_text_task(
            TEXT_VOCAB,
            EOS_ID,
            max_prompt_tokens=TEXT_PROMPT_TOKENS,
            max_tokens_limit=TEXT_CONTEXT - TEXT_PROMPT_TOKENS,
        ),
        speech=SpeechTask(
            walk="speak",
            prompt_input="prompt_ids",
            max_tokens_input="max_new_tokens",
            waveform_channel="waveform",
            sample_rate=SAMPLE_RATE,
            vocab_size=SPEECH_VOCAB,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            max_tokens_limit=128,
            default_max_tokens=32,
            encode=speech_tok.encode,
        ),
        image=ImageTask(
            walk="generate",
            prompt_input="prompt_ids",
            noise_input="noise",
            noise_shape=NOISE_SHAPE,
            size=IMAGE_SIZE,
            vocab_size=IMAGE_VOCAB,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            image_output="image",
            encode=image_tok.encode,
            edit_walk="edit",
            image_input="image",
        ),
    )
