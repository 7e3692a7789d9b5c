"""``/v1/audio/transcriptions`` for an Omni thinker that takes audio (a ``chat_audio`` walk):
the ``TranscriptionTask`` of its profile (``with_transcription``; Qwen3-Omni's through
``with_qwen3_transcription``, Qwen2.5-Omni's in ``qwen25_omni.profiles``). The clip's features
come from the upstream feature extractor (``WhisperFeatureExtractor``: the checkpoint's
``preprocessor_config.json``, or one built for a tiny config's mel bins), called as the
model's upstream processor calls it (``padding``: Qwen3-Omni's pads to the clip,
``padding=True, truncation=False``; Qwen2.5-Omni's to the extractor's 30 s,
``padding="max_length"``), with the frame mask. The prompt is one user turn of the chat
template, the audio first and then the instruction, laid out as the processor expands the
model's audio placeholders (``AudioLayout``)::

    <|im_start|> user \\n <start> <pad> x N <end> Transcribe ... <|im_end|>
    \\n <|im_start|> assistant \\n              N = the encoder's tokens for the clip's frames

    Qwen3-Omni    <|audio_start|> <|audio_pad|> <|audio_end|>
    Qwen2.5-Omni  <|audio_bos|>   <|AUDIO|>     <|audio_eos|>

The request's ``language`` and ``prompt`` go into the instruction (``instruction``).

What crosses the boundary: token ids and a count function from the adapter (``AudioLayout``),
the names of its walk (``AudioWalk``), the extractor and how it pads, the profile's encode and
chat template; out comes an ``api.profile.TranscriptionTask``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.api.profile import (
    AudioFeatures,
    AudioPrompt,
    Encode,
    ModelProfile,
    TranscriptionTask,
)

TINY_AUDIO_SECONDS = 30.0  # the tiny models' clip limit (their encoder is slow on CPU)
CHECKPOINT_AUDIO_SECONDS = 600.0
TRANSCRIBE = "Transcribe the audio into text."
AUDIO_MARK = "\x00audio\x00"  # where the clip goes in the rendered turn (never in a template)
FEATURE_RATE = 16000  # Whisper-style extractors' sampling rate


@dataclass(frozen=True)
class AudioLayout:
    """How a prompt holds one clip: start, ``count(frames)`` placeholders, end."""

    start: int
    pad: int
    end: int
    count: Callable[[int], int]  # mel frames -> the audio encoder's tokens


def instruction(language: str | None, context: str | None) -> str:
    """The instruction after the clip: which language to write, and earlier text the client
    gives as context (OpenAI's ``prompt``)."""
    text = TRANSCRIBE if language is None else f"Transcribe the audio into text in {language}."
    if context:
        text += f" The audio continues this text: {context}"
    return text


def audio_prompt(
    encode: Encode, chat: Callable[[Sequence[tuple[str, str]]], str], layout: AudioLayout
) -> AudioPrompt:
    def prompt(frames: int, language: str | None, context: str | None) -> list[int]:
        rendered = chat([("user", AUDIO_MARK + instruction(language, context))])
        before, after = rendered.split(AUDIO_MARK, 1)
        clip = [layout.start, *[layout.pad] * layout.count(frames), layout.end]
        return [*encode(before), *clip, *encode(after)]

    return prompt


Padding = bool | str  # True: to the longest clip; "max_length": to the extractor's chunk


def padding_settings(padding: Padding) -> dict[str, Any]:
    """The extractor's padding keywords as the upstream processors pass them: Qwen3-Omni's
    ``padding=True, truncation=False``; Qwen2.5-Omni's ``padding="max_length"`` with the
    extractor's truncation left on (clips are refused past its chunk, so nothing is cut)."""
    if padding is True:
        return {"padding": True, "truncation": False}
    return {"padding": padding}


def whisper_features(extractor: Any, padding: Padding = True) -> AudioFeatures:
    """``extractor`` (a transformers feature extractor) as upstream's processor calls it on one
    clip, padded as ``padding_settings`` says."""
    settings = padding_settings(padding)

    def features(waveform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [samples]
        out = extractor(
            waveform.numpy(),
            sampling_rate=extractor.sampling_rate,
            return_attention_mask=True,
            return_tensors="pt",
            **settings,
        )
        return out["input_features"], out["attention_mask"].to(torch.int64)  # [1, mel, T], [1, T]

    return features


def tiny_extractor(num_mel_bins: int) -> Any:
    """Whisper's extractor with a tiny config's mel bins (there is no checkpoint file)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=FEATURE_RATE)


def checkpoint_extractor(path: str) -> Any | None:
    """The checkpoint's extractor (``preprocessor_config.json``); None when it has none (then
    the model is served without transcription)."""
    from transformers import WhisperFeatureExtractor

    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return None
    return WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)


@dataclass(frozen=True)
class AudioWalk:
    """The walk that reads a clip and the names of its inputs and outputs."""

    walk: str
    prompt_input: str
    features_input: str
    mask_input: str
    max_tokens_input: str
    leads: tuple[str, ...]
    text_channel: str


def transcription_task(
    walk: AudioWalk,
    extractor: Any,
    encode: Encode,
    chat: Callable[[Sequence[tuple[str, str]]], str],
    layout: AudioLayout,
    max_tokens: int,
    max_audio_seconds: float,
    padding: Padding = True,
) -> TranscriptionTask:
    return TranscriptionTask(
        walk=walk.walk,
        prompt_input=walk.prompt_input,
        features_input=walk.features_input,
        mask_input=walk.mask_input,
        max_tokens_input=walk.max_tokens_input,
        leads=walk.leads,
        text_channel=walk.text_channel,
        sample_rate=int(extractor.sampling_rate),
        features=whisper_features(extractor, padding),
        prompt=audio_prompt(encode, chat, layout),
        max_tokens=max_tokens,
        max_audio_seconds=max_audio_seconds,
    )


#: the ``chat_audio`` walk as both Omni adapters name it; Qwen3-Omni's leads with one token,
#: Qwen2.5-Omni's with two (``first_token``, ``second_token``)
CHAT_AUDIO_WALK = AudioWalk(
    walk="chat_audio",
    prompt_input="input_ids",
    features_input="input_features",
    mask_input="feature_attention_mask",
    max_tokens_input="max_new_tokens",
    leads=("first_token",),
    text_channel="text_tokens",
)


def with_transcription(
    profile: ModelProfile,
    walk: AudioWalk,
    layout: AudioLayout,
    extractor: Any | None,
    max_audio_seconds: float,
    padding: Padding = True,
) -> ModelProfile:
    """``profile`` with transcription over ``walk``: the clip's placeholders as ``layout``
    lays them out, its features from ``extractor`` padded as ``padding`` says (as the model's
    upstream processor calls it). Without an extractor, ``profile`` unchanged."""
    if extractor is None:
        return profile
    text = profile.text
    if text is None:
        raise ValueError(f"{profile.name}: transcription needs the profile's text task")
    task = transcription_task(
        walk,
        extractor,
        text.encode,
        text.chat_template,
        layout,
        max_tokens=text.max_tokens_limit,
        max_audio_seconds=max_audio_seconds,
        padding=padding,
    )
    return dataclasses.replace(profile, transcription=task)


def with_qwen3_transcription(
    profile: ModelProfile, config: Any, extractor: Any | None, max_audio_seconds: float
) -> ModelProfile:
    """``profile`` (a Qwen3-Omni profile from ``omni_http``) with transcription over the
    thinker's ``chat_audio`` walk; ``config`` the model's ``Qwen3OmniMoeConfig``."""
    from walkserve.adapters.qwen3_omni import audio_token_count

    thinker = config.thinker_config
    n_window = int(thinker.audio_config.n_window)
    layout = AudioLayout(
        start=int(thinker.audio_start_token_id),
        pad=int(thinker.audio_token_id),
        end=int(thinker.audio_end_token_id),
        count=lambda frames: int(audio_token_count(frames, n_window)),
    )
    return with_transcription(profile, CHAT_AUDIO_WALK, layout, extractor, max_audio_seconds)
