"""Qwen2.5-Omni instances: the tiny random model (``tiny_config``, ``tiny``), the sample
request that captures every walk (``media_sample``), the upstream references
(``upstream_speech``; ``tiny_processor``: upstream's ``Qwen2_5OmniProcessor`` for the tiny
config, which makes the media walks' inputs from images and clips as a checkpoint's
processor does) and the checkpoint loader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from walkserve.adapters.qwen25_omni.media_walks import audio_token_count
from walkserve.adapters.qwen25_omni.walks import Qwen25OmniWalks


def tiny_config() -> Any:
    """A Qwen2.5-Omni config small enough for CPU tests (see ``reference/facts.md``)."""
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    media = dict(audio_token_index=240, image_token_index=241, video_token_index=242)
    media |= dict(audio_start_token_id=243, audio_end_token_id=238)
    text = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters=rope,
        initializer_range=0.15,
        max_position_embeddings=4096,
    )
    thinker = dict(
        text_config=text,
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=32,
            max_source_positions=100,
            n_window=4,
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
            window_size=8,
            fullatt_block_indexes=[0],
        ),
        user_token_id=246,
        vision_start_token_id=244,
        vision_end_token_id=239,
        initializer_range=0.15,
        **media,
    )
    talker = dict(
        vocab_size=128,
        tts_text_start_token_id=253,
        tts_text_end_token_id=254,
        tts_text_pad_token_id=252,
        tts_codec_start_token_id=120,
        tts_codec_end_token_id=121,
        tts_codec_pad_token_id=122,
        tts_codec_mask_token_id=123,
        vision_start_token_id=244,
        vision_end_token_id=239,
        embedding_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_parameters=rope,
        initializer_range=0.15,
        max_position_embeddings=4096,
        **media,
    )
    dit = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ff_mult=2,
        emb_dim=16,
        head_dim=16,
        num_embeds=128,
        mel_dim=16,
        enc_emb_dim=16,
        enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48],
        enc_attention_channels=8,
        enc_se_channels=8,
        block_size=4,
        look_ahead_layers=[1],
        look_backward_layers=[0],
    )
    bigvgan = dict(
        mel_dim=16,
        upsample_initial_channel=128,
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3, 5]],
        upsample_rates=[2, 2, 2, 2, 2, 2],
        upsample_kernel_sizes=[4, 4, 4, 4, 4, 4],
    )
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan),
    )


TINY_SPEAKER_BOS = 250
TINY_SPEAKER_BOS_2 = 248  # "Ethan"


def tiny(seed: int = 0) -> tuple[Qwen25OmniWalks, dict[str, Any]]:
    """Zero-argument factory: the tiny random model as walks, and a sample request. The
    speaker map (normally ``spk_dict.pt``) is made by hand: "Chelsie" and "Ethan"."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from walkserve.adapters.qwen3_omni import chat_prompt

    torch.manual_seed(seed)
    config = tiny_config()
    model = Qwen2_5OmniForConditionalGeneration(config).eval().requires_grad_(False)
    model.speaker_map = {
        "Chelsie": {
            "bos_token": TINY_SPEAKER_BOS,
            "cond": torch.randn(1, 16),
            "ref_mel": torch.randn(1, 30, 16),
        }
    }
    model.speaker_map["Ethan"] = {  # drawn after Chelsie's: her tensors stay as they were
        "bos_token": TINY_SPEAKER_BOS_2,
        "cond": torch.randn(1, 16),
        "ref_mel": torch.randn(1, 24, 16),
    }
    walks = Qwen25OmniWalks(model, thinker_eos_id=251)  # <|im_end|>
    placeholders, media = media_sample(config, 37, (4, 8))
    sample = {  # one prompt for every walk: image and audio placeholders, then text
        "input_ids": chat_prompt(_Ids(), [*placeholders, 10, 11, 12, 13]),
        **media,
        "max_new_tokens": 12,
        "max_audio_tokens": 30,
        "text_bos_id": TINY_SPEAKER_BOS,
    }
    return walks, sample


def upstream_speech(
    walks: Qwen25OmniWalks,
    request: Mapping[str, Any],
    seed: int,
    speaker: str = "Chelsie",
    walk: str = "speak",
) -> tuple[Tensor, Tensor, Tensor]:
    """The reference for a request of ``walk``: ``speak``, or ``speak_audio`` /
    ``speak_image`` / ``speak_media`` (the media inputs that walk takes go to ``generate()``
    too; a ``speak`` request's others are left out, as ``speak`` leaves them): greedy upstream ``generate()`` after ``torch.manual_seed(seed)`` -> (new text tokens
    [1, n], talker tokens [1, m], waveform [samples]). ``generate()`` hands the talker every
    input it does not route to the thinker, ``pixel_values`` among them, which the talker's
    forward cannot take (transformers 5.24): the spy on ``talker.generate`` drops it (the
    talker reads none of the media: ``generate()`` drops its all-ones attention mask, so it
    computes no rotary positions from the grids)."""
    from walkserve.adapters.qwen25_omni.media_walks import MEDIA_INPUTS

    kinds = {"speak": (), "speak_audio": MEDIA_INPUTS[:2], "speak_image": MEDIA_INPUTS[2:]}
    kinds["speak_media"] = MEDIA_INPUTS
    if walk not in kinds:
        raise ValueError(f"walk {walk!r} is none of {sorted(kinds)}")
    media = {k: request[k] for k in kinds[walk]}
    model: Any = walks.upstream
    seen: dict[str, Tensor] = {}
    talker_generate = model.talker.generate

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        kwargs.pop("pixel_values", None)
        seen["codes"] = out = talker_generate(*args, **kwargs)
        return out

    model.talker.generate = spy
    try:
        torch.manual_seed(seed)
        sequences, waveform = model.generate(
            request["input_ids"],
            speaker=speaker,
            thinker_max_new_tokens=request["max_new_tokens"],
            thinker_eos_token_id=walks.eos,
            thinker_do_sample=False,
            talker_max_new_tokens=request["max_audio_tokens"],
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_eos_token_id=list(walks.codec_eos),
            **media,
        )
    finally:
        del model.talker.generate
    prompt = request["input_ids"].shape[1]
    return sequences[:, prompt:], seen["codes"][:, prompt + 2 :], waveform


class _Ids:
    """The chat-template ids of the tiny config (Qwen2.5-Omni's config does not name them)."""

    im_start_token_id = 250
    im_end_token_id = 251
    user_token_id = 246
    assistant_token_id = 247


def load_qwen25_omni(
    path: str, speaker: str = "Chelsie", thinker_eos_id: int = 151645
) -> tuple[Qwen25OmniWalks, dict[str, Any]]:
    """A local Qwen2.5-Omni checkpoint directory (safetensors and its ``spk_dict.pt``, which
    upstream reads with ``torch.load(weights_only=True)``) as walks; ``<|im_end|>`` ends the
    thinker's reply."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model: Any = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, local_files_only=True)
    model.eval().requires_grad_(False)
    model.token2wav.float()  # as generate() runs it
    if speaker not in model.speaker_map:
        raise ValueError(
            f"unknown speaker {speaker!r}; this checkpoint has {sorted(model.speaker_map)}"
        )
    walks = Qwen25OmniWalks(model, thinker_eos_id)
    vocab = int(model.config.thinker_config.text_config.vocab_size)
    placeholders, media = media_sample(model.config, 160, (4, 4))
    ids = [151644, 872, *placeholders, 9707, 151645, 198, 151644, 77091, 198]  # user: "Hello"
    if max(ids) >= vocab:
        ids = [i % vocab for i in ids]
    sample = {
        "input_ids": torch.tensor([ids]),
        **media,
        "max_new_tokens": 8,
        "max_audio_tokens": 32,
        "text_bos_id": int(model.speaker_map[speaker]["bos_token"]),
    }
    return walks, sample


def media_sample(
    config: Any, frames: int, grid_hw: tuple[int, int], seed: int = 0
) -> tuple[list[int], dict[str, Tensor]]:
    """The media of the sample request that captures every walk (a walk's inputs come from one
    mapping): the user turn's placeholders, an image's (``<|IMAGE|> x h*w/merge^2
    <|vision_eos|>``), a video's (``<|VIDEO|> x 2*h*w/merge^2 <|vision_eos|>``) and a clip's
    (``<|AUDIO|> x audio_token_count(frames)``), none with its bos token: each walk reads the
    other kinds' placeholders as text, and every walk's positions are plain (upstream
    ``get_rope_index`` reads a vision bos token followed by an image or video placeholder as
    that kind, whose grid a walk of the other kind does not have); and random
    ``input_features`` [1, mel, frames], ``feature_attention_mask``, ``pixel_values``
    [h * w, C * T * p * p], ``image_grid_thw`` [[1, h, w]], ``pixel_values_videos``
    [2 * h * w, C * T * p * p], ``video_grid_thw`` [[2, h, w]], ``video_second_per_grid``
    (seeded)."""
    thinker = config.thinker_config
    vision = thinker.vision_config
    h, w = grid_hw
    merge = int(vision.spatial_merge_size)
    if h % merge or w % merge:
        raise ValueError(f"grid {grid_hw} is not a multiple of the merge size {merge}")
    g = torch.Generator().manual_seed(seed)
    patch = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    mel = int(thinker.audio_config.num_mel_bins)
    image = [*[thinker.image_token_index] * (h * w // merge**2), thinker.vision_end_token_id]
    video = [*[thinker.video_token_index] * (2 * h * w // merge**2), thinker.vision_end_token_id]
    clip = [thinker.audio_token_index] * int(audio_token_count(frames))
    return [*image, *video, *clip], {
        "input_features": torch.randn(1, mel, frames, generator=g),
        "feature_attention_mask": torch.ones(1, frames, dtype=torch.int64),
        "pixel_values": torch.randn(h * w, patch, generator=g),
        "image_grid_thw": torch.tensor([[1, h, w]]),
        "pixel_values_videos": torch.randn(2 * h * w, patch, generator=g),
        "video_grid_thw": torch.tensor([[2, h, w]]),
        "video_second_per_grid": torch.tensor([1.0]),
    }


# The tiny config's text specials, named as Qwen2.5-Omni's tokenizer names them.
TINY_SPECIALS = {
    "<|audio_eos|>": 238,
    "<|vision_eos|>": 239,
    "<|AUDIO|>": 240,
    "<|IMAGE|>": 241,
    "<|VIDEO|>": 242,
    "<|audio_bos|>": 243,
    "<|vision_bos|>": 244,
    "system": 245,
    "user": 246,
    "assistant": 247,
    "<|im_start|>": 250,
    "<|im_end|>": 251,
}


def tiny_processor() -> Any:
    """Upstream ``Qwen2_5OmniProcessor`` for the tiny config: the feature extractor and image
    processor the tiny profile serves with (``omni_transcribe.tiny_extractor``,
    ``omni_chatmedia.tiny_image_processor``) and a byte-level tokenizer of the tiny ids (bytes
    < 238 as themselves, ``TINY_SPECIALS``: ``TinyChatTokenizer``'s ids). Its video processor
    is upstream's where torchvision imports, else ``omni_video.TorchVideoProcessor`` (the
    served path, checked against upstream's own code in ``tests/unit/test_omni_video.py``),
    both with the tiny profile's settings; videos go in with their frames picked
    (``omni_video.pick_frames``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5OmniProcessor

    from walkserve.adapters import omni_chatmedia, omni_transcribe

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = _byte_chars()
    vocab = {alphabet[b]: b for b in range(238)} | TINY_SPECIALS
    tok = Tokenizer(models.WordLevel(vocab, unk_token=alphabet[ord("?")]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([byte_level, pre_tokenizers.Split("", "isolated")])
    tok.decoder = decoders.ByteLevel()
    named = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>"}
    named |= {"vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>"}
    named |= {"audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=named)
    fast.add_special_tokens({"additional_special_tokens": list(TINY_SPECIALS)})
    thinker = tiny_config().thinker_config
    extractor = omni_transcribe.tiny_extractor(int(thinker.audio_config.num_mel_bins))
    images = omni_chatmedia.tiny_image_processor(thinker.vision_config)

    class WithoutVideo(Qwen2_5OmniProcessor):  # type: ignore[misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    processor = WithoutVideo(
        image_processor=images, video_processor=None, feature_extractor=extractor, tokenizer=fast
    )
    from walkserve.adapters import omni_video

    settings = omni_video.tiny_video_settings(thinker.vision_config, omni_video.TINY_VIDEO_PIXELS)
    upstream = omni_video.upstream_video_processor(settings)
    processor.video_processor = upstream or omni_video.TorchVideoProcessor(settings)
    return processor


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in table)
    table |= {b: chr(256 + n) for n, b in enumerate(shifted)}
    return table
