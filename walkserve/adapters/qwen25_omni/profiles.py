"""Qwen2.5-Omni's HTTP profiles: ``/v1/chat/completions`` text and audio, ``/v1/audio/speech``
(see ``adapters.omni_http``; text chat runs ``speak`` with a one-code talker), chat with
audio clips and images (``with_qwen25_chat_media``: the media walks, text or audio out) and
``/v1/audio/transcriptions`` (``with_qwen25_transcription``: the ``chat_audio`` walk), the
tiny model's and a local checkpoint's."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from walkserve.adapters.qwen25_omni.instances import (
    TINY_SPEAKER_BOS,
    TINY_SPEAKER_BOS_2,
    Qwen25OmniWalks,
    _Ids,
    tiny,
)
from walkserve.adapters.qwen25_omni.media_walks import audio_token_count

if TYPE_CHECKING:
    from walkserve.adapters.omni_video import VideoSettings
    from walkserve.api.profile import ModelProfile, VideoLimits

QWEN_IM_END = 151645  # <|im_end|>: the thinker's EOS (as load_qwen25_omni's default)


def qwen25_walk_names(default_bos: int) -> Any:
    """Which walks, inputs and outputs serve which route (``omni_http.OmniWalkNames``)."""
    from walkserve.adapters.omni_http import OmniWalkNames

    return OmniWalkNames(
        chat_walk="speak",
        speech_walk="speak",
        prompt_input="input_ids",
        text_limit_input="max_new_tokens",
        audio_limit_input="max_audio_tokens",
        leads=("first_token", "second_token"),
        text_channel="text_tokens",
        waveform="waveform",
        chat_extra={"max_audio_tokens": 1, "text_bos_id": default_bos},
    )


def qwen25_voices(speakers: Mapping[str, int]) -> Any:
    """The speaker map's speakers (``spk_dict.pt``) as voices, each setting ``text_bos_id``
    (the speaker's ``bos_token``); "Chelsie" by default, as ``load_qwen25_omni``."""
    from walkserve.adapters.omni_http import voices_from

    if not speakers:
        raise ValueError("the speaker map names no speakers")
    return voices_from(speakers, "text_bos_id", "Chelsie")


def tiny_profile(name: str) -> ModelProfile:
    """``tiny``'s routes (speakers "Chelsie", "Ethan"); text through ``TinyChatTokenizer``."""
    from walkserve.adapters.omni_http import (
        TINY_LIMITS,
        ChatIds,
        TinyChatTokenizer,
        chatml,
        omni_profile,
    )

    ids = ChatIds(
        im_start=_Ids.im_start_token_id,
        im_end=_Ids.im_end_token_id,
        system=245,
        user=_Ids.user_token_id,
        assistant=_Ids.assistant_token_id,
    )
    tok = TinyChatTokenizer(ids, first_special=238)
    profile = omni_profile(
        name,
        qwen25_walk_names(TINY_SPEAKER_BOS),
        TINY_LIMITS,
        eos_id=_Ids.im_end_token_id,
        vocab_size=256,
        encode=tok.encode,
        decode=tok.decode,
        chat=chatml,
        voices=qwen25_voices({"Chelsie": TINY_SPEAKER_BOS, "Ethan": TINY_SPEAKER_BOS_2}),
    )
    from walkserve.adapters.omni_chatmedia import tiny_image_processor
    from walkserve.adapters.omni_transcribe import tiny_extractor
    from walkserve.adapters.omni_video import (
        TINY_VIDEO_LIMITS,
        TINY_VIDEO_PIXELS,
        tiny_video_settings,
    )
    from walkserve.adapters.qwen25_omni.instances import tiny_config

    thinker = tiny_config().thinker_config
    extractor = tiny_extractor(int(thinker.audio_config.num_mel_bins))
    images = tiny_image_processor(thinker.vision_config)
    video = tiny_video_settings(thinker.vision_config, TINY_VIDEO_PIXELS)
    profile = with_qwen25_transcription(profile, thinker, extractor)
    return with_qwen25_chat_media(profile, thinker, extractor, images, video, TINY_VIDEO_LIMITS)


def checkpoint_profile(path: str, name: str) -> ModelProfile:
    """A local Qwen2.5-Omni checkpoint's routes: its tokenizer and chat template, its
    speakers from ``spk_dict.pt`` (read with ``weights_only=True``)."""
    from walkserve.adapters.omni_http import (
        CHECKPOINT_LIMITS,
        checkpoint_text,
        omni_profile,
    )

    spk_path = os.path.join(path, "spk_dict.pt")
    if not os.path.isfile(spk_path):
        raise ValueError(f"{path} has no spk_dict.pt: the speakers of a Qwen2.5-Omni checkpoint")
    spk = torch.load(spk_path, map_location="cpu", weights_only=True)
    speakers = {str(k): int(v["bos_token"]) for k, v in spk.items()}
    voices = qwen25_voices(speakers)
    default_bos = speakers[voices.default]
    encode, decode, chat = checkpoint_text(path)
    from transformers import AutoConfig

    config: Any = AutoConfig.from_pretrained(path, local_files_only=True)
    profile = omni_profile(
        name,
        qwen25_walk_names(default_bos),
        CHECKPOINT_LIMITS,
        eos_id=QWEN_IM_END,
        vocab_size=int(config.thinker_config.text_config.vocab_size),
        encode=encode,
        decode=decode,
        chat=chat,
        voices=voices,
    )
    from transformers import Qwen2_5OmniProcessor

    from walkserve.adapters.omni_chatmedia import checkpoint_image_processor
    from walkserve.adapters.omni_transcribe import checkpoint_extractor
    from walkserve.adapters.omni_video import checkpoint_video_settings

    thinker = config.thinker_config
    extractor = checkpoint_extractor(path)
    images = checkpoint_image_processor(path, thinker.vision_config)
    size: Any = Qwen2_5OmniProcessor.videos_kwargs["size"]  # what its calls pass
    video = checkpoint_video_settings(path, thinker.vision_config, size)
    profile = with_qwen25_transcription(profile, thinker, extractor)
    return with_qwen25_chat_media(profile, thinker, extractor, images, video)


def with_qwen25_transcription(
    profile: ModelProfile, thinker: Any, extractor: Any | None
) -> ModelProfile:
    """``profile`` with ``/v1/audio/transcriptions`` over the ``chat_audio`` walk (without an
    extractor, unchanged): the clip as upstream's ``Qwen2_5OmniProcessor`` makes it, features
    padded to the extractor's 30 s (``padding="max_length"``; longer clips are refused, as the
    processor would cut them) and ``<|audio_bos|> <|AUDIO|> x audio_token_count(frames)
    <|audio_eos|>``; ``thinker`` the model's ``thinker_config``."""
    from walkserve.adapters.omni_transcribe import (
        CHAT_AUDIO_WALK,
        AudioLayout,
        with_transcription,
    )

    if extractor is None:
        return profile
    walk = dataclasses.replace(CHAT_AUDIO_WALK, leads=("first_token", "second_token"))
    layout = AudioLayout(
        start=int(thinker.audio_start_token_id),
        pad=int(thinker.audio_token_index),
        end=int(thinker.audio_end_token_id),
        count=lambda frames: int(audio_token_count(frames)),
    )
    seconds = float(extractor.chunk_length)
    return with_transcription(profile, walk, layout, extractor, seconds, padding="max_length")


def with_qwen25_chat_media(
    profile: ModelProfile,
    thinker: Any,
    extractor: Any | None,
    image_processor: Any | None,
    video_settings: VideoSettings | None = None,
    video_limits: VideoLimits | None = None,
) -> ModelProfile:
    """``profile`` whose chat takes audio clips (with an extractor), images (with an image
    processor) and videos (with video settings), made into walk inputs as upstream's
    ``Qwen2_5OmniProcessor`` makes them: the clips through the extractor at once, padded to
    its 30 s (``padding="max_length"``; longer clips are refused, as the processor would cut
    them), each image through the image processor, each video's frames at the settings' fps
    through ``omni_video`` (``chat_video``, text out only); audio out through ``speak_audio``
    / ``speak_image`` / ``speak_media``. ``thinker`` the model's ``thinker_config``."""
    from walkserve.adapters.omni_chatmedia import audio_inputs, image_inputs, with_chat_media
    from walkserve.adapters.omni_video import pick_frames, video_inputs
    from walkserve.api.profile import FramePicker, MediaWalk, all_frames

    audio = image = video = None
    if extractor is not None:
        placeholders = (
            int(thinker.audio_start_token_id),
            int(thinker.audio_token_index),
            int(thinker.audio_end_token_id),
        )
        clips = audio_inputs(extractor, *placeholders, audio_token_count, padding="max_length")
        audio = MediaWalk("chat_audio", clips, speak_walk="speak_audio")
    if image_processor is not None:
        placeholders = (
            int(thinker.vision_start_token_id),
            int(thinker.image_token_index),
            int(thinker.vision_end_token_id),
        )
        image = MediaWalk(
            "chat_image", image_inputs(image_processor, *placeholders), speak_walk="speak_image"
        )
    frames: FramePicker = all_frames
    if video_settings is not None:
        placeholders = (
            int(thinker.vision_start_token_id),
            int(thinker.video_token_index),
            int(thinker.vision_end_token_id),
        )
        video = MediaWalk("chat_video", video_inputs(video_settings, *placeholders))
        frames = pick_frames(video_settings)
    rate = int(extractor.sampling_rate) if extractor is not None else 16000
    seconds = float(extractor.chunk_length) if extractor is not None else 30.0
    return with_chat_media(
        profile,
        audio,
        image,
        rate,
        seconds,
        mixed_speak_walk="speak_media",
        video=video,
        video_frames=frames,
        video_limits=video_limits,
    )


AUDIBLE_GAIN = 4e6  # the random token2wav's waveform peaks near 1.2e-7: under one pcm16 step


def tiny_audible(seed: int = 0) -> tuple[Qwen25OmniWalks, dict[str, Any]]:
    """``tiny`` with BigVGAN's output convolution scaled by ``AUDIBLE_GAIN``, so that its
    waveform survives 16-bit PCM (HTTP tests compare audio as pcm16; the plain tiny model's
    is all zeros). Thinker, talker and DiT are ``tiny``'s."""
    walks, sample = tiny(seed)
    bigvgan: Any = walks.token2wav.token2wav.code2wav_bigvgan_model
    bigvgan.conv_post.weight.mul_(AUDIBLE_GAIN)  # Conv1d(channels, 1, 7): the waveform
    return walks, sample


def tiny_audible_profile(name: str) -> ModelProfile:
    return tiny_profile(name)
