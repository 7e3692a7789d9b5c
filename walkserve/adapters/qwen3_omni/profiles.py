"""Qwen3-Omni's HTTP profiles (``/v1/chat/completions`` text and audio,
``/v1/audio/speech``: see ``adapters.omni_http``) and the environment-named checkpoint
factories."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from walkserve.api.profile import ModelProfile

from walkserve.adapters.qwen3_omni.instances import (
    TINY_VOCAB,
    load_qwen3_omni,
    tiny,
    tiny_config,
)
from walkserve.adapters.qwen3_omni.walks import Qwen3OmniWalks


def qwen3_walk_names() -> Any:
    """Which walks, inputs and outputs serve which route (``omni_http.OmniWalkNames``)."""
    from walkserve.adapters.omni_http import OmniWalkNames

    return OmniWalkNames(
        chat_walk="chat",
        speech_walk="speak",
        prompt_input="input_ids",
        text_limit_input="max_new_tokens",
        audio_limit_input="max_audio_tokens",
        leads=("first_token",),
        text_channel="text_tokens",
        waveform="waveform",
    )


TINY_NEWLINE = 10  # "\n" as a byte of the tiny tokenizer
QWEN3_VIDEO_FPS = 1.0  # Qwen3OmniMoeProcessor's fps when its call gives none (seconds a grid)
TINY_FIRST_SPECIAL = 238  # the tiny config's special ids are 238 .. 255


def qwen3_chat_ids(config: Any) -> Any:
    from walkserve.adapters.omni_http import ChatIds

    return ChatIds(
        im_start=int(config.im_start_token_id),
        im_end=int(config.im_end_token_id),
        system=int(config.system_token_id),
        user=int(config.user_token_id),
        assistant=int(config.assistant_token_id),
    )


def qwen3_voices(config: Any) -> Any:
    """The checkpoint's speakers (``config.talker_config.speaker_id``) as voices, each setting
    the ``speaker_id`` walk input; "ethan" by default, as ``load_qwen3_omni``."""
    from walkserve.adapters.omni_http import voices_from

    speakers = {str(k).lower(): int(v) for k, v in (config.talker_config.speaker_id or {}).items()}
    if not speakers:
        raise ValueError("the checkpoint's talker_config.speaker_id names no speakers")
    return voices_from(speakers, "speaker_id", "ethan")


def tiny_profile(name: str) -> ModelProfile:
    """``tiny``'s routes: text chat (``chat`` walk), chat with audio and read-aloud speech
    (``speak``), voices "ethan" and "chelsie"; text through ``TinyChatTokenizer``."""
    from walkserve.adapters.omni_http import (
        TINY_LIMITS,
        TinyChatTokenizer,
        chatml,
        omni_profile,
    )
    from walkserve.adapters.omni_transcribe import (
        TINY_AUDIO_SECONDS,
        tiny_extractor,
        with_qwen3_transcription,
    )

    walks, _ = tiny()  # its thinker EOS (tiny_eos) depends on the seeded weights
    config = tiny_config()
    tok = TinyChatTokenizer(qwen3_chat_ids(config), TINY_FIRST_SPECIAL)
    profile = omni_profile(
        name,
        qwen3_walk_names(),
        TINY_LIMITS,
        eos_id=walks.eos,
        vocab_size=TINY_VOCAB,
        encode=tok.encode,
        decode=tok.decode,
        chat=chatml,
        voices=qwen3_voices(config),
    )
    extractor = tiny_extractor(int(config.thinker_config.audio_config.num_mel_bins))
    profile = with_qwen3_transcription(profile, config, extractor, TINY_AUDIO_SECONDS)
    from walkserve.adapters import omni_chatmedia as cm
    from walkserve.adapters.omni_video import (
        TINY_VIDEO_LIMITS,
        TINY_VIDEO_PIXELS,
        tiny_video_settings,
    )

    vision = config.thinker_config.vision_config
    images = cm.tiny_image_processor(vision)
    video = replace(tiny_video_settings(vision, TINY_VIDEO_PIXELS), fps=QWEN3_VIDEO_FPS)
    return cm.with_qwen3_chat_media(
        profile, config, extractor, images, TINY_AUDIO_SECONDS, video, TINY_VIDEO_LIMITS
    )


def checkpoint_profile(path: str, name: str) -> ModelProfile:
    """A local Qwen3-Omni checkpoint's routes, with its own tokenizer and chat template."""
    from transformers import Qwen3OmniMoeConfig

    from walkserve.adapters.omni_http import (
        CHECKPOINT_LIMITS,
        checkpoint_text,
        omni_profile,
    )
    from walkserve.adapters.omni_transcribe import (
        CHECKPOINT_AUDIO_SECONDS,
        checkpoint_extractor,
        with_qwen3_transcription,
    )

    config: Any = Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True)
    encode, decode, chat = checkpoint_text(path)
    profile = omni_profile(
        name,
        qwen3_walk_names(),
        CHECKPOINT_LIMITS,
        eos_id=int(config.im_end_token_id),
        vocab_size=int(config.thinker_config.text_config.vocab_size),
        encode=encode,
        decode=decode,
        chat=chat,
        voices=qwen3_voices(config),
    )
    extractor = checkpoint_extractor(path)
    profile = with_qwen3_transcription(profile, config, extractor, CHECKPOINT_AUDIO_SECONDS)
    from transformers import Qwen3OmniMoeProcessor

    from walkserve.adapters import omni_chatmedia as cm
    from walkserve.adapters.omni_video import checkpoint_video_settings

    vision = config.thinker_config.vision_config
    images = cm.checkpoint_image_processor(path, vision)
    size: Any = Qwen3OmniMoeProcessor.videos_kwargs["size"]  # what its calls pass
    video = replace(checkpoint_video_settings(path, vision, size), fps=QWEN3_VIDEO_FPS)
    return cm.with_qwen3_chat_media(
        profile, config, extractor, images, CHECKPOINT_AUDIO_SECONDS, video
    )


def from_env() -> tuple[Qwen3OmniWalks, dict[str, Any]]:
    """``load_qwen3_omni($QWEN3_OMNI_DIR)``: a zero-argument factory, so that
    ``serve("walkserve.adapters.qwen3_omni:from_env")`` (and placements naming it) serves a
    local checkpoint; worker processes inherit the environment."""
    return load_qwen3_omni(_env_dir())


def from_env_profile(name: str) -> ModelProfile:
    return checkpoint_profile(_env_dir(), name)


def _env_dir() -> str:
    path = os.environ.get("QWEN3_OMNI_DIR")
    if not path or not os.path.isdir(path):
        raise ValueError("set QWEN3_OMNI_DIR to a local Qwen3-Omni checkpoint directory")
    return path


AUDIBLE_GAIN = 2e4  # the random code2wav's waveform peaks near 2.5e-5: under one pcm16 step


def tiny_audible(seed: int = 0) -> tuple[Qwen3OmniWalks, dict[str, Any]]:
    """``tiny`` with code2wav's output convolution scaled by ``AUDIBLE_GAIN``, so that its
    waveform (peaks near 0.5) survives 16-bit PCM: HTTP tests compare audio as pcm16, and the
    plain tiny model's would be all zeros. Thinker and talker are ``tiny``'s."""
    walks, sample = tiny(seed)
    out = walks.code2wav.decoder[-1].conv  # Conv1d(channels, 1, k): the waveform
    out.weight.mul_(AUDIBLE_GAIN)
    out.bias.mul_(AUDIBLE_GAIN)
    return walks, sample


def tiny_audible_profile(name: str) -> ModelProfile:
    return tiny_profile(name)


def streaming_profile(name: str) -> ModelProfile:
    return tiny_profile(name)
