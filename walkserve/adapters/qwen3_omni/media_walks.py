"""``MediaWalks``: the walks of ``Qwen3OmniWalks`` with media in the prompt, over its
``_think`` (thinker) and ``_speak`` (thinker -> talker -> code2wav):

    chat_audio / speak_audio    audio clips: input_features [clips, mel, T],
                                feature_attention_mask [clips, T]
    chat_image / speak_image    images: pixel_values [patches, C * T * p * p],
                                image_grid_thw [images, 3]
    chat_media                  both in one prompt (upstream's processor takes both)

No ``speak_media``: upstream ``generate()`` cannot speak for a prompt with both (transformers
5.24: the talker's ``get_rope_index`` reads ``config.audio_config``, which the talker's config
lacks), so there is no reference for its codes.

The prompt holds one run of placeholders per clip and per image, in the order of their rows
(``AudioPlaceholders``, ``ImagePlaceholders`` check it), laid out as upstream's processor
does. What crosses the boundary: walk inputs as named above, outputs as ``_think`` /
``_speak`` make them (``first_token``, ``text_tokens``; with speech ``codes``, ``waveform``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from walkserve.adapters.qwen3_omni.inputs import (
    AUDIO_INPUTS,
    GREEDY,
    SEQUENCE,
    AudioPlaceholders,
    ImagePlaceholders,
    _speak_sampling,
)
from walkserve.capture import walk


class MediaWalks:
    """The media walks, mixed into ``Qwen3OmniWalks`` (which owns the modules and loops)."""

    if TYPE_CHECKING:
        audio_placeholders: AudioPlaceholders
        image_placeholders: ImagePlaceholders

        def _think(
            self,
            input_ids: Tensor,
            max_new_tokens: int,
            media: Mapping[str, Tensor] | None = None,
            hidden: bool = False,
            sampling: tuple[Any, ...] = GREEDY,
            prompt_positions: tuple[Tensor, Tensor] | None = None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]: ...

        def _speak(
            self,
            input_ids: Tensor,
            max_new_tokens: int,
            max_audio_tokens: int,
            speaker_id: int,
            media: Mapping[str, Tensor] | None,
            sampling: tuple[Any, ...],
            talker_sampling: tuple[Any, ...],
        ) -> dict[str, Tensor]: ...

    @walk(inputs=AUDIO_INPUTS)
    def chat_audio(
        self,
        input_ids: Tensor,
        input_features: Tensor,
        feature_attention_mask: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> dict[str, Tensor]:
        """``chat`` with audio clips: log-mel ``input_features`` [clips, mel, T]
        and ``feature_attention_mask`` [clips, T] (1 = a real frame), the prompt holding per clip
        ``audio_token_count(frames)`` audio placeholders between audio start and end."""
        input_ids = self.audio_placeholders(input_ids, feature_attention_mask)
        media = {"input_features": input_features, "feature_attention_mask": feature_attention_mask}
        sampling = (temperature, top_p, top_k, seed)
        first, text_tokens, _, _ = self._think(input_ids, max_new_tokens, media, sampling=sampling)
        return {"first_token": first, "text_tokens": text_tokens}

    @walk(inputs={"input_ids": SEQUENCE})
    def chat_image(
        self,
        input_ids: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> dict[str, Tensor]:
        """``chat`` with images: ``pixel_values`` [patches, C * T * p * p] and
        ``image_grid_thw`` [images, 3] as upstream's image processor makes them, the prompt holding
        per image t * h * w / merge^2 placeholders between vision start and end."""
        input_ids = self.image_placeholders(input_ids, pixel_values, image_grid_thw)
        media = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        sampling = (temperature, top_p, top_k, seed)
        first, text_tokens, _, _ = self._think(input_ids, max_new_tokens, media, sampling=sampling)
        return {"first_token": first, "text_tokens": text_tokens}

    @walk(inputs=AUDIO_INPUTS)
    def chat_media(
        self,
        input_ids: Tensor,
        input_features: Tensor,
        feature_attention_mask: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> dict[str, Tensor]:
        """``chat`` with audio clips and images in one prompt (inputs as in ``chat_audio`` and
        ``chat_image``): the thinker's prefill takes both encoders' inputs, as upstream's."""
        input_ids, media = self._media(
            input_ids, input_features, feature_attention_mask, pixel_values, image_grid_thw
        )
        sampling = (temperature, top_p, top_k, seed)
        first, text_tokens, _, _ = self._think(input_ids, max_new_tokens, media, sampling=sampling)
        return {"first_token": first, "text_tokens": text_tokens}

    def _media(
        self,
        input_ids: Tensor,
        input_features: Tensor,
        feature_attention_mask: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The checked prompt and media inputs of a prompt with clips and images."""
        input_ids = self.audio_placeholders(input_ids, feature_attention_mask)
        input_ids = self.image_placeholders(input_ids, pixel_values, image_grid_thw)
        return input_ids, {
            "input_features": input_features,
            "feature_attention_mask": feature_attention_mask,
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
        }

    @walk(inputs=AUDIO_INPUTS)
    def speak_audio(
        self,
        input_ids: Tensor,
        input_features: Tensor,
        feature_attention_mask: Tensor,
        max_new_tokens: int,
        max_audio_tokens: int,
        speaker_id: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        talker_temperature: float = 0.0,
        talker_top_p: float = 1.0,
        talker_top_k: int = 0,
        predictor_temperature: float = 0.0,
        predictor_top_p: float = 1.0,
        predictor_top_k: int = 0,
        talker_repetition_penalty: float = 1.0,
    ) -> dict[str, Tensor]:
        """``speak`` with audio clips (inputs as in ``chat_audio``)."""
        input_ids = self.audio_placeholders(input_ids, feature_attention_mask)
        media = {"input_features": input_features, "feature_attention_mask": feature_attention_mask}
        sampling = _speak_sampling(
            temperature,
            top_p,
            top_k,
            seed,
            talker_temperature,
            talker_top_p,
            talker_top_k,
            predictor_temperature,
            predictor_top_p,
            predictor_top_k,
            talker_repetition_penalty,
        )
        return self._speak(
            input_ids, max_new_tokens, max_audio_tokens, speaker_id, media, *sampling
        )

    @walk(inputs={"input_ids": SEQUENCE})
    def speak_image(
        self,
        input_ids: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
        max_new_tokens: int,
        max_audio_tokens: int,
        speaker_id: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        talker_temperature: float = 0.0,
        talker_top_p: float = 1.0,
        talker_top_k: int = 0,
        predictor_temperature: float = 0.0,
        predictor_top_p: float = 1.0,
        predictor_top_k: int = 0,
        talker_repetition_penalty: float = 1.0,
    ) -> dict[str, Tensor]:
        """``speak`` with images (inputs as in ``chat_image``)."""
        input_ids = self.image_placeholders(input_ids, pixel_values, image_grid_thw)
        media = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        sampling = _speak_sampling(
            temperature,
            top_p,
            top_k,
            seed,
            talker_temperature,
            talker_top_p,
            talker_top_k,
            predictor_temperature,
            predictor_top_p,
            predictor_top_k,
            talker_repetition_penalty,
        )
        return self._speak(
            input_ids, max_new_tokens, max_audio_tokens, speaker_id, media, *sampling
        )
