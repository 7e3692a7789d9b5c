"""Qwen3-Omni instances: the tiny random model for tests (config, seeded weights, EOS), request
builders laid out as upstream's processor does (text, audio, image), the upstream
``generate()`` reference of a speech request, and the local-checkpoint loader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    pass

from walkserve.adapters.qwen3_omni.inputs import audio_token_count
from walkserve.adapters.qwen3_omni.walks import Qwen3OmniWalks

TINY_VOCAB = 256  # thinker vocabulary; special ids at its top
TINY_CODEBOOK = 64  # codec ids 0 .. 63; talker vocabulary 1024 + 64 (generate() reserves 1024)
TINY_SPEAKER = 1070
TINY_CHUNK, TINY_CONTEXT = 8, 4  # small code2wav chunks, so that tiny requests stream audio
TINY_FIRST = 4  # streaming(): the first audio after 4 frames (320 ms of speech)


def tiny_config() -> Any:
    """A Qwen3-Omni config small enough for CPU tests (see ``reference/facts.md``)."""
    from transformers import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    stack = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        rope_parameters=rope,
        initializer_range=0.15,
        max_position_embeddings=8192,
    )
    media = dict(audio_token_id=240, image_token_id=241, video_token_id=242)
    media |= dict(audio_start_token_id=243, vision_start_token_id=244)
    thinker = dict(
        text_config=dict(stack, vocab_size=TINY_VOCAB),
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=32,
            downsample_hidden_size=8,
            max_source_positions=100,
            n_window=50,  # upstream's output-length formula assumes 100-frame chunks (13 tokens)
            n_window_infer=100,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=32,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
        user_token_id=246,
        vision_end_token_id=239,
        audio_end_token_id=238,
        initializer_range=0.15,
        **media,
    )
    predictor = dict(
        vocab_size=TINY_CODEBOOK,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_code_groups=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.15,
    )
    talker = dict(
        text_config=dict(
            stack, vocab_size=1024 + TINY_CODEBOOK, shared_expert_intermediate_size=32
        ),
        code_predictor_config=predictor,
        num_code_groups=4,
        thinker_hidden_size=32,
        accept_hidden_layer=1,
        codec_eos_token_id=1060,
        codec_nothink_id=1061,
        codec_think_bos_id=1062,
        codec_think_eos_id=1063,
        codec_pad_id=1064,
        codec_bos_id=1065,
        speaker_id={"ethan": TINY_SPEAKER, "chelsie": TINY_SPEAKER + 1},
        spatial_merge_size=2,
        initializer_range=0.15,
        **media,
    )
    code2wav = dict(
        codebook_size=TINY_CODEBOOK,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        num_hidden_layers=1,
        num_quantizers=4,
        upsample_rates=[2, 2],
        upsampling_ratios=[2, 2],
        decoder_dim=32,
        sliding_window=72,
        max_position_embeddings=8192,
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=250,
        im_end_token_id=251,
        tts_pad_token_id=252,
        tts_bos_token_id=253,
        tts_eos_token_id=254,
        system_token_id=245,
        user_token_id=246,
        assistant_token_id=247,
    )


def chat_prompt(config: Any, user_ids: list[int], newline: int = 9) -> Tensor:
    """``<|im_start|> user ... <|im_end|> \\n <|im_start|> assistant \\n`` as ids [1, P]."""
    start, end = config.im_start_token_id, config.im_end_token_id
    ids = [start, config.user_token_id, *user_ids, end, newline, start, config.assistant_token_id]
    return torch.tensor([[*ids, newline]])


def audio_chat_prompt(
    config: Any, frames: int, user_ids: list[int] | None = None, newline: int = 9
) -> Tensor:
    """A chat prompt whose user turn starts with one audio clip of ``frames`` mel frames, laid
    out as upstream's processor expands ``<|audio_start|><|audio_pad|><|audio_end|>``:
    ``<|im_start|> user <|audio_start|> <|audio_pad|> x N <|audio_end|> ... <|im_end|> \\n
    <|im_start|> assistant \\n`` with N = ``audio_token_count(frames)``, as ids [1, P]."""
    thinker = config.thinker_config
    n = int(audio_token_count(frames, thinker.audio_config.n_window))
    audio = [thinker.audio_start_token_id, *[thinker.audio_token_id] * n]
    return chat_prompt(config, [*audio, thinker.audio_end_token_id, *(user_ids or [])], newline)


def audio_request(
    config: Any,
    frames: int,
    user_ids: list[int] | None = None,
    padding: int = 0,
    seed: int = 0,
    newline: int = 9,
) -> dict[str, Tensor]:
    """Walk inputs of one audio clip of random log-mel features (seeded): ``input_ids`` [1, P],
    ``input_features`` [1, mel, frames + padding], ``feature_attention_mask`` [1, frames +
    padding] (the last ``padding`` frames masked, as a padded batch of the processor has)."""
    g = torch.Generator().manual_seed(seed)
    mel = int(config.thinker_config.audio_config.num_mel_bins)
    mask = torch.zeros(1, frames + padding, dtype=torch.long)
    mask[:, :frames] = 1
    return {
        "input_ids": audio_chat_prompt(config, frames, user_ids, newline),
        "input_features": torch.randn(1, mel, frames + padding, generator=g),
        "feature_attention_mask": mask,
    }


def image_request(
    config: Any,
    grid_hw: tuple[int, int],
    user_ids: list[int] | None = None,
    seed: int = 0,
    newline: int = 9,
) -> dict[str, Tensor]:
    """Walk inputs of one image of ``grid_hw`` patches (random pixels, seeded), as upstream's
    image processor lays an image out (t = 1): ``input_ids`` [1, P] with ``<|vision_start|>
    <|image_pad|> x (h * w / merge^2) <|vision_end|>`` first in the user turn,
    ``pixel_values`` [h * w, C * T * p * p], ``image_grid_thw`` [[1, h, w]]."""
    thinker = config.thinker_config
    vision = thinker.vision_config
    h, w = grid_hw
    merge = int(vision.spatial_merge_size)
    if h % merge or w % merge:
        raise ValueError(f"grid {grid_hw} is not a multiple of the merge size {merge}")
    patch = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    g = torch.Generator().manual_seed(seed)
    image = [thinker.vision_start_token_id, *[thinker.image_token_id] * (h * w // merge**2)]
    return {
        "input_ids": chat_prompt(
            config, [*image, thinker.vision_end_token_id, *(user_ids or [])], newline
        ),
        "pixel_values": torch.randn(h * w, patch, generator=g),
        "image_grid_thw": torch.tensor([[1, h, w]]),
    }


def media_sample(
    config: Any, frames: int, grid_hw: tuple[int, int], user_ids: list[int], newline: int = 9
) -> dict[str, Tensor]:
    """One sample request for capturing every walk (a walk's inputs come from one mapping):
    a prompt with image, video and then audio placeholders, audio features, pixels and video
    pixels (a video of 2 x ``grid_hw`` patches). The placeholders stand without their start
    tokens, so that each walk reads the other kinds' as text, in their positions too
    (upstream ``get_rope_index`` reads a vision start followed by an image or video
    placeholder as that kind, whose grid a walk of the other kind does not have)."""
    image = image_request(config, grid_hw, seed=1, newline=newline)
    audio = audio_request(config, frames, user_ids, newline=newline)
    thinker = config.thinker_config
    clip = int(audio_token_count(frames, thinker.audio_config.n_window))
    ids = image["input_ids"][0, :-5].tolist()  # up to <|vision_end|>
    ids.remove(thinker.vision_start_token_id)
    h, w = grid_hw
    merge = int(thinker.vision_config.spatial_merge_size)
    ids += [thinker.video_token_id] * (2 * h * w // merge**2) + [thinker.vision_end_token_id]
    ids += [thinker.audio_token_id] * clip
    patches = image["pixel_values"].shape[-1]
    g = torch.Generator().manual_seed(2)
    return {
        **audio,
        **image,
        "input_ids": chat_prompt(config, [*ids[2:], *user_ids], newline),
        "pixel_values_videos": torch.randn(2 * h * w, patches, generator=g),
        "video_grid_thw": torch.tensor([[2, h, w]]),
        "video_second_per_grid": torch.tensor([2.0]),
    }


def tiny_upstream(seed: int = 0) -> Any:
    """The upstream model with the tiny config and seeded random weights."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    config = tiny_config()
    model = Qwen3OmniMoeForConditionalGeneration(config).eval().requires_grad_(False)
    # Upstream's weight init skips the talker's MoE experts (left as torch.empty: whatever the
    # allocator hands out, different between processes): initialize them from the seed.
    g = torch.Generator().manual_seed(seed)
    std = config.talker_config.text_config.initializer_range
    for name, param in model.talker.named_parameters():
        if ".experts." in name:
            param.normal_(0.0, std, generator=g)
    return model


def shard_thinker(model: Any) -> Any:
    """``model`` with, in a worker of the thinker's tensor-parallel group (a placement with
    ``tensor_parallel: {thinker_lm: N}``), this rank's shard of the thinker in place of the
    whole one: its decoder split by transformers' own tp_plan (attention heads, the experts
    (``tp.shard.expert_sharding``), vocabulary-parallel embedding and LM head), its audio and vision encoders
    replicated (``runtime.tp.shard.reload_sharded``). The rank held the whole thinker first:
    loaded, then sharded. Elsewhere ``model`` as it is."""
    from walkserve.runtime.tp.member import current_group

    group = current_group()
    if group is not None:
        from walkserve.runtime.tp.shard import reload_sharded

        model.thinker = reload_sharded(model.thinker, group).requires_grad_(False)
    return model


def tiny_eos(model: Any, prompt: Tensor) -> int:
    """A thinker EOS id that ends the sample prompt's greedy reply after a few tokens: the
    first token, at step 6 or later, that the reply has not emitted before (random weights
    never learn to end a turn)."""
    out = model.thinker.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    reply = out[0, prompt.shape[1] :].tolist()
    for step in range(6, len(reply)):
        if reply[step] not in reply[:step]:
            return int(reply[step])
    return int(model.config.im_end_token_id)


def tiny(seed: int = 0, first_chunk: int | None = None) -> tuple[Qwen3OmniWalks, dict[str, Any]]:
    """Zero-argument factory: the tiny random model as walks, and a sample request."""
    model = tiny_upstream(seed)
    prompt = chat_prompt(model.config, [10, 11, 12, 13, 14])
    eos = tiny_eos(model, prompt)
    walks = Qwen3OmniWalks(shard_thinker(model), eos, TINY_CHUNK, TINY_CONTEXT, first_chunk)
    sample = {  # one prompt for every walk: image and audio placeholders, the text of `prompt`
        **media_sample(model.config, 37, (4, 8), [10, 11, 12, 13, 14]),
        "max_new_tokens": 16,
        "max_audio_tokens": 40,
        "speaker_id": TINY_SPEAKER,
    }
    return walks, sample


MEDIA_INPUTS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")


def upstream_speech(
    walks: Qwen3OmniWalks, request: Mapping[str, Any], speaker: str = "ethan", **generate: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """The reference for a ``speak*`` request: upstream ``generate()`` on the request (its media
    too), greedy unless ``generate`` says otherwise -> (new text tokens [1, n], the codes it
    hands to ``code2wav.chunked_decode`` [1, G, frames], waveform [1, 1, samples])."""
    model: Any = walks.upstream
    seen: dict[str, Tensor] = {}
    decode = model.code2wav.chunked_decode

    def spy(codes: Tensor, **kwargs: Any) -> Tensor:
        seen["codes"] = codes
        return decode(codes, **kwargs)

    settings: dict[str, Any] = {
        "speaker": speaker,
        "thinker_max_new_tokens": request["max_new_tokens"],
        "thinker_eos_token_id": walks.eos,
        "thinker_do_sample": False,
        "talker_max_new_tokens": request["max_audio_tokens"],
        "talker_do_sample": False,
        "talker_repetition_penalty": 1.0,
        **{k: request[k] for k in MEDIA_INPUTS if k in request},
        **generate,
    }
    model.code2wav.chunked_decode = spy
    try:
        sequences, waveform = model.generate(request["input_ids"], **settings)
    finally:
        del model.code2wav.chunked_decode
    return sequences[:, request["input_ids"].shape[1] :], seen["codes"], waveform


def streaming() -> tuple[Qwen3OmniWalks, dict[str, Any]]:
    """``tiny`` with a short first code2wav chunk (``TINY_FIRST`` frames, then ``TINY_CHUNK``):
    the configuration a speech server streams with, so that audio starts before a whole chunk
    of codes exists. ``serve("walkserve.adapters.qwen3_omni:streaming")``."""
    return tiny(first_chunk=TINY_FIRST)


def load_qwen3_omni(path: str, speaker: str = "ethan") -> tuple[Qwen3OmniWalks, dict[str, Any]]:
    """A local Qwen3-Omni checkpoint directory (safetensors, no downloads) as walks, with
    upstream chunk sizes and ``<|im_end|>`` as the thinker's EOS. The sample request (for
    capture) holds 1.6 s of random audio features (100 mel frames per second) and a random
    image of 4 x 4 patches."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config: Any = Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True)
    speakers = config.talker_config.speaker_id or {}
    if speaker.lower() not in speakers:
        raise ValueError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(speakers)}")
    model: Any = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        path, config=config, local_files_only=True
    )
    model.eval().requires_grad_(False)
    walks = Qwen3OmniWalks(shard_thinker(model), int(model.config.im_end_token_id))
    vocab = int(model.config.thinker_config.text_config.vocab_size)
    hello, newline = (9707, 198) if vocab > 9707 else (vocab // 2, 9)  # Qwen tokenizer ids
    sample = {
        **media_sample(model.config, 160, (4, 4), [hello], newline=newline),
        "max_new_tokens": 8,
        "max_audio_tokens": 32,
        "speaker_id": int(speakers[speaker.lower()]),
    }
    return walks, sample
