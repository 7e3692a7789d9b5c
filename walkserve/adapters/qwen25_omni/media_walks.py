"""``MediaWalks``: Qwen2.5-Omni's thinker with media in the prompt, mixed into
``Qwen25OmniWalks`` (which owns the modules, the sampler and the EOS):

    chat_audio / speak_audio  audio clips: input_features [clips, mel, T],
                              feature_attention_mask [clips, T]
    chat_image / speak_image  images: pixel_values [patches, C * T * p * p],
                              image_grid_thw [images, 3]
    chat_media / speak_media  both in one prompt (upstream's processor takes both)

``speak_*`` run the talker and token2wav after the thinker as ``speak`` does (``_speak``), on
the talker inputs upstream ``generate()`` makes: the prompt term is last hidden state + input
embedding with the input embedding zeroed on the clips' and images' placeholder rows. The
talker reads nothing else of the media: ``generate()`` hands it the grids and clip lengths,
but drops its all-ones attention mask, and without a mask the talker computes no rotary
positions of its own (default positions, as in ``speak``).

The prompt holds one run of placeholders per clip and per image, in the order of their rows
(``Qwen25AudioPlaceholders``, ``ImagePlaceholders`` check it), laid out as upstream's
``Qwen2_5OmniProcessor`` does::

    <|audio_bos|> <|AUDIO|> x audio_token_count(frames) <|audio_eos|>
    <|vision_bos|> <|IMAGE|> x t*h*w/merge^2 <|vision_eos|>

The thinker's prefill takes the encoder inputs (its audio and vision towers run inside it).
Images move the rotary positions (``RopePositions``: upstream ``get_rope_index``, the clips'
lengths counted too); upstream keeps that offset on the module (``rope_deltas``), the walks
carry it per request into every decode step (``step_positions``). Outputs as ``speak``'s, so
the profile's text and chat-audio tasks read them: ``first_token`` [1, 1], ``second_token``
[1, 1], ``text_tokens`` [1, n - 2] (streamed); with ``speak_*`` also ``first_code``, ``codes``
and ``waveform``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.qwen3_omni.inputs import (
    AUDIO_INPUTS,
    SEQUENCE,
    AudioPlaceholders,
    ImagePlaceholders,
    _read_now,
)
from walkserve.capture import iterations, loop, walk

if TYPE_CHECKING:
    from walkserve.adapters.speech_sampling import TokenSampler

MEDIA_INPUTS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")


def audio_token_count(frames: int | Tensor) -> Tensor:
    """Audio placeholders (= audio encoder outputs) for ``frames`` mel frames (an int or a
    tensor of counts): upstream's own formula (``processing_qwen2_5_omni``), int64."""
    from transformers.models.qwen2_5_omni import processing_qwen2_5_omni as upstream

    count: Tensor = upstream._get_feat_extract_output_lengths(torch.as_tensor(frames))
    return count


class Qwen25AudioPlaceholders(AudioPlaceholders):
    """``AudioPlaceholders`` with Qwen2.5-Omni's count of encoder tokens per clip."""

    def __init__(self, audio_token: int) -> None:
        super().__init__(audio_token, n_window=0)  # the count needs no window

    def count(self, frames: Tensor) -> Tensor:
        return audio_token_count(frames)


class RopePositions(nn.Module):
    """M-RoPE positions of a prompt with images: upstream ``get_rope_index`` of the thinker
    (clips counted by their frames, ``feature_attention_mask``). -> ``position_ids`` [3, B, P]
    (t / h / w rows) and ``rope`` [B, 1], the prompt's largest position: decode step k (k = 1
    for the first token after the prefill) is at ``rope + k`` in all rows, as upstream's
    ``rope_deltas`` put it."""

    def __init__(self, thinker: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "thinker", thinker)  # not a submodule

    def forward(
        self, input_ids: Tensor, image_grid_thw: Tensor, feature_attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        # input_ids: [B, P], image_grid_thw: [images, 3], feature_attention_mask: [clips, T]
        seqlens = None if feature_attention_mask is None else feature_attention_mask.sum(-1)
        thinker: Any = self.thinker
        positions, _ = thinker.get_rope_index(
            input_ids, image_grid_thw, None, torch.ones_like(input_ids), False, seqlens
        )
        return positions, positions.amax(dim=0).amax(dim=-1, keepdim=True)  # [3, B, P], [B, 1]


def step_positions(rope: Tensor, count: Tensor) -> Tensor:
    """``position_ids`` [3, B, 1] of a decode step: ``rope`` [B, 1] + ``count`` [B, 1] (tokens
    generated so far) in every row."""
    return (rope + count).unsqueeze(0).repeat(3, 1, 1)


class MediaWalks:
    """The media walks, mixed into ``Qwen25OmniWalks``."""

    if TYPE_CHECKING:
        audio_placeholders: Qwen25AudioPlaceholders
        image_placeholders: ImagePlaceholders
        thinker_positions: RopePositions
        thinker_sampler: TokenSampler
        thinker_lm: Any
        eos: int

        def _speak(
            self,
            thought: dict[str, Tensor],
            prompt_part: Tensor,
            reply0: Tensor,
            reply_items: Tensor,
            text_bos_id: int,
            max_audio_tokens: int,
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
        """The thinker's reply to a prompt with audio clips: log-mel ``input_features``
        [clips, mel, T] and ``feature_attention_mask`` [clips, T] (1 = a real frame), as
        upstream's processor makes them."""
        input_ids, media = self._audio(input_ids, input_features, feature_attention_mask)
        return self._chat(input_ids, max_new_tokens, media, (temperature, top_p, top_k, seed))

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
        """The thinker's reply to a prompt with images: ``pixel_values`` [patches,
        C * T * p * p] and ``image_grid_thw`` [images, 3] as upstream's image processor makes
        them."""
        input_ids, media = self._image(input_ids, pixel_values, image_grid_thw)
        return self._chat(input_ids, max_new_tokens, media, (temperature, top_p, top_k, seed))

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
        """The thinker's reply to a prompt with audio clips and images (inputs as in
        ``chat_audio`` and ``chat_image``)."""
        input_ids, audio = self._audio(input_ids, input_features, feature_attention_mask)
        input_ids, image = self._image(input_ids, pixel_values, image_grid_thw)
        media = audio | image
        return self._chat(input_ids, max_new_tokens, media, (temperature, top_p, top_k, seed))

    @walk(inputs=AUDIO_INPUTS)
    def speak_audio(
        self,
        input_ids: Tensor,
        input_features: Tensor,
        feature_attention_mask: Tensor,
        max_new_tokens: int,
        max_audio_tokens: int,
        text_bos_id: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        talker_temperature: float = 0.0,
        talker_top_p: float = 1.0,
        talker_top_k: int = 0,
        talker_repetition_penalty: float = 1.0,
    ) -> dict[str, Tensor]:
        """``chat_audio`` spoken: the talker and token2wav after it, as ``speak``'s (the
        speaker by ``text_bos_id``, the talker sampling inputs as ``speak``'s)."""
        input_ids, media = self._audio(input_ids, input_features, feature_attention_mask)
        talker = (talker_temperature, talker_top_p, talker_top_k, seed, talker_repetition_penalty)
        sampling = (temperature, top_p, top_k, seed)
        return self._speak_media(
            input_ids, media, max_new_tokens, max_audio_tokens, text_bos_id, sampling, talker
        )

    @walk(inputs={"input_ids": SEQUENCE})
    def speak_image(
        self,
        input_ids: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
        max_new_tokens: int,
        max_audio_tokens: int,
        text_bos_id: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        talker_temperature: float = 0.0,
        talker_top_p: float = 1.0,
        talker_top_k: int = 0,
        talker_repetition_penalty: float = 1.0,
    ) -> dict[str, Tensor]:
        """``chat_image`` spoken (as ``speak_audio``)."""
        input_ids, media = self._image(input_ids, pixel_values, image_grid_thw)
        talker = (talker_temperature, talker_top_p, talker_top_k, seed, talker_repetition_penalty)
        sampling = (temperature, top_p, top_k, seed)
        return self._speak_media(
            input_ids, media, max_new_tokens, max_audio_tokens, text_bos_id, sampling, talker
        )

    @walk(inputs=AUDIO_INPUTS)
    def speak_media(
        self,
        input_ids: Tensor,
        input_features: Tensor,
        feature_attention_mask: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
        max_new_tokens: int,
        max_audio_tokens: int,
        text_bos_id: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        talker_temperature: float = 0.0,
        talker_top_p: float = 1.0,
        talker_top_k: int = 0,
        talker_repetition_penalty: float = 1.0,
    ) -> dict[str, Tensor]:
        """``chat_media`` spoken (as ``speak_audio``)."""
        input_ids, audio = self._audio(input_ids, input_features, feature_attention_mask)
        input_ids, image = self._image(input_ids, pixel_values, image_grid_thw)
        media = audio | image
        talker = (talker_temperature, talker_top_p, talker_top_k, seed, talker_repetition_penalty)
        sampling = (temperature, top_p, top_k, seed)
        return self._speak_media(
            input_ids, media, max_new_tokens, max_audio_tokens, text_bos_id, sampling, talker
        )

    def _audio(
        self, input_ids: Tensor, input_features: Tensor, feature_attention_mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The prompt with each clip's placeholders laid out, and the clips as the thinker
        takes them."""
        input_ids = self.audio_placeholders(input_ids, feature_attention_mask)
        return input_ids, {
            "input_features": input_features,
            "feature_attention_mask": feature_attention_mask,
        }

    def _image(
        self, input_ids: Tensor, pixel_values: Tensor, image_grid_thw: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The prompt with each image's placeholders laid out, and the images as the thinker
        takes them."""
        input_ids = self.image_placeholders(input_ids, pixel_values, image_grid_thw)
        return input_ids, {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}

    def _speak_media(
        self,
        input_ids: Tensor,
        media: Mapping[str, Tensor],
        max_new_tokens: int,
        max_audio_tokens: int,
        text_bos_id: int,
        sampling: tuple[Any, ...],
        talker_sampling: tuple[Any, ...],
    ) -> dict[str, Tensor]:
        thought, parts = self._think(input_ids, max_new_tokens, media, sampling, hidden=True)
        assert parts is not None
        return self._speak(thought, *parts, text_bos_id, max_audio_tokens, talker_sampling)

    def _chat(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        media: Mapping[str, Tensor],
        sampling: tuple[Any, ...],
        positions: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        thought, _ = self._think(input_ids, max_new_tokens, media, sampling, False, positions)
        return thought

    def _think(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        media: Mapping[str, Tensor],
        sampling: tuple[Any, ...],
        hidden: bool,
        prompt_positions: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], tuple[Tensor, Tensor, Tensor] | None]:
        """Prefill with the media -> t0; the step feeding t0 -> t1; the loop -> t2 ..
        (EOS / max_new_tokens). ``sampling``: ``(temperature, top_p, top_k, seed)``. Every step
        gets explicit positions from ``rope`` [B, 1], a per-request loop input. With ``hidden``
        also the talker's inputs, as ``speak``'s thinker part makes them: the prompt term
        [B, P, D] (last hidden state + input embedding, the input embedding zeroed on the
        media's placeholder rows as upstream ``generate()`` zeroes them), reply0 [B, 1, D] and
        the reply items [B, n - 2, D + 1]. ``prompt_positions``: the prompt's (``position_ids``
        [3, B, P], ``rope``) where the walk computed them (videos); else from the images'
        grids, or plain."""
        extra: dict[str, Any] = dict(media)
        if hidden:
            extra["output_hidden_states"] = True
        if prompt_positions is None and "image_grid_thw" in media:
            mask = media.get("feature_attention_mask")
            prompt_positions = self.thinker_positions(input_ids, media["image_grid_thw"], mask)
        if prompt_positions is not None:
            extra["position_ids"], rope = prompt_positions  # [3, B, P], [B, 1]
        out = self.thinker_lm(input_ids=input_ids, use_cache=True, **extra)
        cache = _read_now(out.cache)
        prompt_part = None
        if hidden:
            tokens = self.audio_placeholders.audio_token, self.image_placeholders.image_token
            keep = ~torch.isin(input_ids, torch.tensor(tokens, device=input_ids.device))  # [B, P]
            embeds = out.hidden_states[0] * keep.unsqueeze(-1).to(out.hidden_states[0].dtype)
            prompt_part = out.hidden_states[-1] + embeds  # [B, P, D]
        first = self.thinker_sampler(out.logits[:, -1:], 0, *sampling)  # [B, 1]: t0
        count = first * 0 + 1  # [B, 1]
        if prompt_positions is None:  # plain positions (text, audio), as upstream's
            rope = first * 0 + (input_ids.shape[1] - 1)  # [B, 1]
        step = {"output_hidden_states": True} if hidden else {}
        out = self.thinker_lm(
            input_ids=first,
            cache=cache,
            use_cache=True,
            position_ids=step_positions(rope, count),
            **step,
        )
        cache = _read_now(out.cache)
        token = second = self.thinker_sampler(out.logits[:, -1:], 1, *sampling)  # [B, 1]: t1
        count = count + 1
        positions = step_positions(rope, count)  # [3, B, 1]: the next step's
        tokens_out, items = [], []
        for _ in iterations(max_new_tokens):
            if hidden:
                cache, token, count, positions, item, done = self.think_aloud_step(
                    cache, token, count, positions, rope, max_new_tokens, *sampling
                )
                items.append(item)
            else:
                cache, token, count, positions, done = self.chat_step(
                    cache, token, count, positions, rope, max_new_tokens, *sampling
                )
            tokens_out.append(token)
            if done:
                break
        thought = {"first_token": first, "second_token": second}
        thought["text_tokens"] = torch.cat(tokens_out, 1)
        if prompt_part is None:
            return thought, None
        reply0 = out.hidden_states[-1] + out.hidden_states[0]  # [B, 1, D]: of t0
        return thought, (prompt_part, reply0, torch.cat(items, 1))

    @loop(max_iters="max_new_tokens")
    def chat_step(
        self,
        cache: Any,
        token: Tensor,
        count: Tensor,
        positions: Tensor,
        rope: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor]:
        out = self.thinker_lm(input_ids=token, cache=cache, use_cache=True, position_ids=positions)
        cache = _read_now(out.cache)
        logits = out.logits[:, -1:]  # [B, 1, V]
        token = self.thinker_sampler(logits, count, temperature, top_p, top_k, seed)  # [B, 1]
        count = count + 1
        positions = step_positions(rope, count)  # [3, B, 1]: the next step's
        last = (token == self.eos) | (count >= max_new_tokens)  # [B, 1]
        return cache, token, count, positions, last.all()

    @loop(max_iters="max_new_tokens")
    def think_aloud_step(
        self,
        cache: Any,
        token: Tensor,
        count: Tensor,
        positions: Tensor,
        rope: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``chat_step`` that also emits the reply item of the token fed (``speak``'s
        ``think_step``: last hidden state + input embedding, flagged when the token it outputs
        is the last)."""
        out = self.thinker_lm(
            input_ids=token,
            cache=cache,
            use_cache=True,
            position_ids=positions,
            output_hidden_states=True,
        )
        cache = _read_now(out.cache)
        reply = out.hidden_states[-1] + out.hidden_states[0]  # [B, 1, D]
        token = self.thinker_sampler(out.logits[:, -1:], count, temperature, top_p, top_k, seed)
        count = count + 1
        positions = step_positions(rope, count)  # [3, B, 1]: the next step's
        last = (token == self.eos) | (count >= max_new_tokens)  # [B, 1]
        item = torch.cat([reply, last.unsqueeze(-1).to(reply.dtype)], dim=-1)  # [B, 1, D + 1]
        return cache, token, count, positions, item, last.all()
