"""What the tiny Qwen3-Omni e2e modules (``test_speech_http``, ``test_chat_media_http``)
compare the server against: the model's name and config, the prompts and media inputs built as
upstream's processor builds them, and audio compared as 16-bit PCM (equal within one LSB of
rounding)."""

from __future__ import annotations

from typing import Any

import torch

from walkserve.adapters import omni_http, qwen3_omni
from walkserve.api import audiocodec, media

OMNI = "walkserve.adapters.qwen3_omni:tiny_audible"
CONFIG = qwen3_omni.tiny_config()
SPEAKERS = CONFIG.talker_config.speaker_id
LIMITS = omni_http.TINY_LIMITS
CLIP = torch.sin(torch.arange(32000) / 11.0) * 0.3  # 2 s at 16 kHz


def chat_ids(user_text: str) -> torch.Tensor:
    """The ChatML prompt of one user turn, by the adapter's own builder ([1, P])."""
    return qwen3_omni.chat_prompt(CONFIG, list(b"\n" + user_text.encode()), 10)


def pcm(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32)


def ref_pcm(waveform: torch.Tensor) -> torch.Tensor:
    return pcm(media.pcm16(waveform))


def assert_pcm_close(got: bytes, want: torch.Tensor) -> None:
    samples = pcm(got)
    assert samples.shape == want.shape and samples.numel() > 0
    assert want.abs().max() > 1000  # audible: the comparison means something
    assert (samples - want).abs().max().item() <= 1  # float rounding may flip one LSB


def transcript(out: dict[str, Any], eos: int, max_tokens: int) -> str:
    """The reply's text: t0 then the streamed tokens, up to (without) EOS, at most
    ``max_tokens``; the tiny tokenizer's bytes (ids >= 238 are specials, dropped)."""
    tokens = [int(out["first_token"]), *out["text_tokens"].reshape(-1).tolist()][:max_tokens]
    tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
    return bytes(t for t in tokens if t < 238).decode("utf-8", errors="replace")


def clips_features(clips: list[bytes]) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Several clips' walk inputs as upstream's processor makes them: WhisperFeatureExtractor
    called once on all of them (padded to the longest), and each clip's placeholders."""
    from transformers import WhisperFeatureExtractor

    audio_config = CONFIG.thinker_config.audio_config
    waves = [audiocodec.decode(clip, 16000, 60.0).numpy() for clip in clips]
    extractor = WhisperFeatureExtractor(feature_size=audio_config.num_mel_bins)
    out = extractor(
        waves,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = out["attention_mask"].to(torch.int64)
    thinker = CONFIG.thinker_config
    ids = []
    for frames in mask.sum(-1).tolist():
        count = int(qwen3_omni.audio_token_count(frames, audio_config.n_window))
        ids.append([thinker.audio_start_token_id, *[thinker.audio_token_id] * count])
        ids[-1].append(thinker.audio_end_token_id)
    return {"input_features": out["input_features"], "feature_attention_mask": mask}, ids


def clip_features(clip: bytes) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One clip's walk inputs and placeholders (``clips_features``)."""
    inputs, [ids] = clips_features([clip])
    return inputs, ids
