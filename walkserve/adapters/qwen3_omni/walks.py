"""``Qwen3OmniWalks``: the walks (``chat*``, ``speak*``) around an upstream
``Qwen3OmniMoeForConditionalGeneration``, its thinker, talker and code predictor on the paged KV
pool (``decoders``); see the package docstring for the flow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.speech_sampling import TokenSampler
from walkserve.capture import (
    FixedChunk,
    LeftContext,
    iterations,
    loop,
    mark_component,
    register_component,
    stream,
    walk,
)
from walkserve.runtime.kv.paged_lm import PagedLMConfig

if TYPE_CHECKING:
    pass

from walkserve.adapters.qwen3_omni.decoders import (
    PredictorOnPool,
    TalkerOnPool,
    ThinkerOnPool,
)
from walkserve.adapters.qwen3_omni.inputs import (
    FEED_EOS,
    FEED_PAD,
    GREEDY,
    MAX_TALKER_STEPS,
    MAX_THINKER_STEPS,
    SEQUENCE,
    AudioPlaceholders,
    ImagePlaceholders,
    MropePositions,
    OmniTokens,
    StepInput,
    TalkerPrompt,
    TalkerText,
    _read_now,
    _speak_sampling,
    step_positions,
)
from walkserve.adapters.qwen3_omni.video_walk import VideoMropePositions, VideoWalk


class Qwen3OmniWalks(VideoWalk, nn.Module):
    """Walks ``chat`` (thinker only) and ``speak`` (thinker -> talker -> code2wav) around an
    upstream ``Qwen3OmniMoeForConditionalGeneration``; the media walks (``MediaWalks``) and
    ``chat_video`` (``VideoWalk``)."""

    def __init__(
        self,
        model: Any,
        thinker_eos_id: int,
        chunk_size: int = 300,
        left_context: int = 25,
        first_chunk: int | None = None,
        pool: PagedLMConfig | None = None,
    ) -> None:
        """``pool``: each decoder's KV pool (tokens, page size; the server's pool settings
        override it)."""
        super().__init__()
        if not getattr(model, "has_talker", False):
            raise ValueError("the model has no talker: load it with enable_audio_output=True")
        register_component(ThinkerOnPool, engine="kv_cache")
        register_component(TalkerOnPool, engine="kv_cache", speculative=False)
        register_component(PredictorOnPool, engine="kv_cache", speculative=False)
        register_component(type(model.code2wav), engine="stateless")
        for cls in (
            TalkerText,
            TalkerPrompt,
            StepInput,
            AudioPlaceholders,
            ImagePlaceholders,
            MropePositions,
            VideoMropePositions,
        ):
            register_component(cls, engine="stateless")
        self.tokens = OmniTokens.of(model.config)
        object.__setattr__(self, "upstream", model)  # for reference runs; not a submodule
        self.eos = thinker_eos_id
        self.groups = int(model.config.talker_config.num_code_groups)
        self.chunk_size, self.left_context = chunk_size, left_context
        # LeftContext(L, C, first=F): the first audio after F frames, then C at a time.
        self.first_chunk = first_chunk
        self.upsample = int(model.code2wav.total_upsample)
        self.codebook = int(model.config.code2wav_config.codebook_size)
        self.thinker: Any = model.thinker  # Qwen3OmniMoeThinkerForConditionalGeneration
        self.talker: Any = model.talker  # Qwen3OmniMoeTalkerForConditionalGeneration
        self.code2wav: Any = model.code2wav  # Qwen3OmniMoeCode2Wav
        codec_embed = model.talker.get_input_embeddings()
        text = TalkerText(
            model.thinker.get_input_embeddings(), model.talker.text_projection, self.tokens
        )
        self.first_code_embed = mark_component(codec_embed, engine="stateless")
        thinker_config = model.config.thinker_config
        media_ids = (
            thinker_config.audio_token_id,
            thinker_config.image_token_id,
            thinker_config.video_token_id,
        )
        self.accept_layer = int(model.config.talker_config.accept_hidden_layer)
        self.talker_prompt = TalkerPrompt(
            text, codec_embed, self.tokens, model.talker.hidden_projection, media_ids
        )
        self.audio_placeholders = AudioPlaceholders(
            thinker_config.audio_token_id, thinker_config.audio_config.n_window
        )
        self.image_placeholders = ImagePlaceholders(
            thinker_config.image_token_id, thinker_config.vision_config.spatial_merge_size
        )
        self.thinker_positions = MropePositions(model.thinker)
        self.talker_positions = MropePositions(model.talker, self.tokens)
        merge = thinker_config.vision_config.spatial_merge_size
        self.video_placeholders = ImagePlaceholders(thinker_config.video_token_id, merge, "video")
        self.video_positions = VideoMropePositions(model.thinker)
        self.step_input = StepInput(
            codec_embed, model.talker.code_predictor.get_input_embeddings(), text
        )
        vocab = int(model.config.talker_config.text_config.vocab_size)
        # generate() suppresses the top 1024 talker ids (control tokens) except codec EOS.
        suppressed = torch.zeros(vocab, dtype=torch.bool)
        suppressed[vocab - 1024 :] = True
        suppressed[self.tokens.codec_eos] = False
        self.suppressed: Tensor
        self.register_buffer("suppressed", suppressed, persistent=False)
        # The three decoders on the paged pool (after the upstream modules, so that these keep
        # their paths: talker.model.codec_embedding is a component of its own).
        self.thinker_lm = ThinkerOnPool(model.thinker, pool)
        self.talker_lm = TalkerOnPool(model.talker, pool)
        self.predictor_lm = PredictorOnPool(model.talker.code_predictor, pool)
        self.thinker_sampler = TokenSampler(stream=0)
        self.talker_sampler = TokenSampler(stream=1)
        self.predictor_sampler = TokenSampler(stream=2)

    # ------------------------------------------------------------------ thinker

    @walk(inputs={"input_ids": SEQUENCE})
    def chat(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> dict[str, Tensor]:
        sampling = (temperature, top_p, top_k, seed)
        first, text_tokens, _, _ = self._think(input_ids, max_new_tokens, sampling=sampling)
        return {"first_token": first, "text_tokens": text_tokens}

    def _think(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        media: Mapping[str, Tensor] | None = None,
        hidden: bool = False,
        sampling: tuple[Any, ...] = GREEDY,
        prompt_positions: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """-> t0 [B, 1], the decode loop's tokens t1 .. t{n-1} [B, n - 1] (a streamed channel),
        the talker's feed items [B, n - 1], and with ``hidden`` the prefill's hidden states of
        layer ``accept_hidden_layer`` [B, P, D] (for the talker's media positions). ``media``:
        the thinker's encoder inputs, given to the prefill. ``sampling``: the thinker's
        ``(temperature, top_p, top_k, seed)``. Every decode step gets explicit positions from
        ``rope`` [B, 2], a per-request loop input (``MropePositions``): with images the
        multimodal positions of the prompt; else (text, audio: plain positions upstream) the
        prompt's last position. Nothing is read from upstream's ``rope_deltas`` module
        attribute, which concurrent requests would share. ``prompt_positions``: the prompt's
        (``position_ids``, ``rope``) where the walk computed them (videos)."""
        extra: dict[str, Any] = dict(media or {})
        mrope = prompt_positions
        if mrope is None and "image_grid_thw" in extra:
            mrope = self._positions(self.thinker_positions, input_ids, extra)
        if mrope is not None:
            extra["position_ids"] = mrope[0]  # [4, B, P]
        if hidden:
            extra["output_hidden_states"] = True
        out = self.thinker_lm(input_ids=input_ids, use_cache=True, **extra)
        cache = _read_now(out.cache)
        accepted = out.hidden_states[self.accept_layer] if hidden else None  # [B, P, D]
        first = token = self.thinker_sampler(out.logits[:, -1:], 0, *sampling)  # [B, 1]: t0
        count = token * 0 + 1  # [B, 1] (elementwise: runs in the thinker's dispatch)
        if mrope is not None:
            rope = mrope[1]  # [B, 2]
        else:
            rope = (token * 0).repeat(1, 2) + (input_ids.shape[1] - 1)  # [B, 2]
        # The first step's positions; each step then makes the next one's after its forward,
        # so that they are computed in the thinker's dispatch rather than in one of their own.
        positions = step_positions(rope, count)  # [4, B, 1]
        tokens, feeds = [], []
        for _ in iterations(max_new_tokens):
            cache, token, count, positions, feed, done = self.think_step(
                cache, token, count, positions, rope, max_new_tokens, *sampling
            )
            tokens.append(token)
            feeds.append(feed)
            if done:
                break
        return first, torch.cat(tokens, dim=1), torch.cat(feeds, dim=1), accepted

    @loop(max_iters="max_new_tokens")
    def think_step(
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
        out = self.thinker_lm(input_ids=token, cache=cache, use_cache=True, position_ids=positions)
        cache = _read_now(out.cache)
        logits = out.logits[:, -1:]  # [B, 1, V]
        token = self.thinker_sampler(logits, count, temperature, top_p, top_k, seed)  # [B, 1]
        count = count + 1
        positions = step_positions(rope, count)  # [4, B, 1]: the next step's
        last = (token == self.eos) | (count >= max_new_tokens)  # [B, 1]
        feed = token - (token - FEED_EOS) * last  # the talker's text item: FEED_EOS if last
        return cache, token, count, positions, feed, last.all()

    # ------------------------------------------------------------------ speech

    @walk(inputs={"input_ids": SEQUENCE})
    def speak(
        self,
        input_ids: Tensor,
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
        return self._speak(input_ids, max_new_tokens, max_audio_tokens, speaker_id, None, *sampling)

    def _speak(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        max_audio_tokens: int,
        speaker_id: int,
        media: Mapping[str, Tensor] | None,
        sampling: tuple[Any, ...],
        talker_sampling: tuple[Any, ...],
    ) -> dict[str, Tensor]:
        """``sampling``: the thinker's ``(temperature, top_p, top_k, seed)``;
        ``talker_sampling``: the talker's ``(temperature, top_p, top_k, seed,
        repetition_penalty)`` then the code predictor's ``(temperature, top_p, top_k)``."""
        first, text_tokens, feeds, hidden = self._think(
            input_ids, max_new_tokens, media, hidden=media is not None, sampling=sampling
        )

        if hidden is None:
            prompt = self.talker_prompt(input_ids, first, speaker_id)  # [B, U + 9, D]
        else:  # media placeholders: the talker's hidden projection of the thinker's states
            prompt = self.talker_prompt(input_ids, first, speaker_id, hidden)
        extra: dict[str, Any] = {}
        if media is not None and "image_grid_thw" in media:  # the talker's own mrope positions
            positions = self._positions(self.talker_positions, input_ids, media)
            extra["position_ids"] = positions[0]  # [4, B, U + 9]
        out = self.talker_lm(
            inputs_embeds=prompt, use_cache=True, output_hidden_states=True, **extra
        )
        cache = _read_now(out.cache)
        hidden = out.hidden_states[-1][:, -1:]  # [B, 1, D]: last layer, last position
        # The codes generate() penalizes (talker repetition_penalty): each one generated (the
        # talker gets no prompt ids upstream). seen: [B, V_talker] bool
        seen = torch.zeros_like(out.logits[:, -1], dtype=torch.bool)
        code = self._pick_code(out.logits[:, -1:], 0, talker_sampling[:5], seen)  # [B, 1]: c0
        seen = seen.scatter(1, code, True)
        count = torch.ones_like(code)
        if extra:
            rope = positions[1]  # [B, 2]
        else:  # plain positions (text, audio), as upstream: decode steps follow the prompt's
            rope = (code * 0).repeat(1, 2) + (prompt.shape[1] - 1)  # [B, 2]
        frames = []
        for item in stream(feeds, FixedChunk(1), dim=1):  # item: [B, 1]
            cache, code, hidden, count, seen, new, done = self.talk_item(
                cache, code, hidden, count, seen, rope, item, max_audio_tokens, *talker_sampling
            )
            frames.append(new)
            if done:
                break
        codes = torch.cat(frames, dim=2)  # [B, G, frames]

        pieces = []
        policy = LeftContext(self.left_context, self.chunk_size, first=self.first_chunk)
        for chunk, n_ctx in stream(codes, policy, dim=2):
            pieces.append(self.decode_chunk(chunk, n_ctx))
        waveform = torch.cat(pieces, dim=-1)  # [B, 1, samples]
        return {
            "first_token": first,
            "text_tokens": text_tokens,
            "codes": codes,
            "waveform": waveform,
        }

    @staticmethod
    def _positions(
        positions: MropePositions, input_ids: Tensor, media: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """``positions`` of a prompt with images (and audio clips, whose lengths they need)."""
        if "feature_attention_mask" in media:
            return positions(input_ids, media["image_grid_thw"], media["feature_attention_mask"])
        return positions(input_ids, media["image_grid_thw"])

    def _pick_code(
        self, logits: Tensor, step: Tensor | int, sampling: tuple[Any, ...], seen: Tensor
    ) -> Tensor:
        masked = logits.masked_fill(self.suppressed, float("-inf"))  # [B, 1, V]
        return self.talker_sampler(masked, step, *sampling, seen)  # [B, 1]

    @loop(max_iters=MAX_THINKER_STEPS, speculative=False)
    def talk_item(
        self,
        cache: Any,
        code: Tensor,
        hidden: Tensor,
        count: Tensor,
        seen: Tensor,
        rope: Tensor,
        item: Tensor,
        limit: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        repetition_penalty: float,
        predictor_temperature: float,
        predictor_top_p: float,
        predictor_top_k: int,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The talker steps of one text item: one, or for the <eos> item, on until codec EOS."""
        feed = item
        frames = []
        sampling: tuple[Any, ...] = (temperature, top_p, top_k, seed, repetition_penalty)
        sampling += (predictor_temperature, predictor_top_p, predictor_top_k)
        for _ in range(MAX_TALKER_STEPS):
            cache, code, hidden, count, seen, feed, frame, stop = self.talk_step(
                cache, code, hidden, count, seen, feed, rope, item, limit, *sampling
            )
            frames.append(frame)
            if stop:
                break
        done = ((code == self.tokens.codec_eos) | (count >= limit)).all()
        return cache, code, hidden, count, seen, torch.cat(frames, dim=2), done

    @loop(max_iters=MAX_TALKER_STEPS, speculative=False)
    def talk_step(
        self,
        cache: Any,
        code: Tensor,
        hidden: Tensor,
        count: Tensor,
        seen: Tensor,
        feed: Tensor,
        rope: Tensor,
        item: Tensor,
        limit: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        repetition_penalty: float,
        predictor_temperature: float,
        predictor_top_p: float,
        predictor_top_k: int,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        predictor_sampling = (predictor_temperature, predictor_top_p, predictor_top_k, seed)
        frame = self.predict_residuals(hidden, code, count, predictor_sampling)  # [B, G, 1]
        embeds = self.step_input(frame, feed)  # [B, 1, D]
        out = self.talker_lm(
            inputs_embeds=embeds,
            cache=cache,
            use_cache=True,
            position_ids=step_positions(rope, count),  # [4, B, 1]
            output_hidden_states=True,
            generation_step=0,  # only echoed back (+1) by the upstream forward
        )
        cache = _read_now(out.cache)
        hidden = out.hidden_states[-1][:, -1:]  # [B, 1, D]
        sampling = (temperature, top_p, top_k, seed, repetition_penalty)
        code = self._pick_code(out.logits[:, -1:], count, sampling, seen)
        count = count + 1
        ended = (code == self.tokens.codec_eos) | (count >= limit)  # [B, 1]
        stop = (ended | (item != FEED_EOS)).all()  # a text item gets one step, <eos> the rest
        pad = torch.full_like(feed, FEED_PAD)
        return cache, code, hidden, count, seen.scatter(1, code, True), pad, frame, stop

    def predict_residuals(
        self, hidden: Tensor, code: Tensor, frame_index: Tensor, sampling: tuple[Any, ...]
    ) -> Tensor:
        """The code predictor's residual codes of ``code`` (frame ``frame_index`` [B, 1] of the
        request) -> the frame [B, G, 1]. ``sampling``: ``(temperature, top_p, top_k, seed)``;
        draw ``g`` of frame ``f`` is the predictor sampler's step ``f * G + g``."""
        first = self.first_code_embed(code)  # [B, 1, D]
        out = self.predictor_lm(inputs_embeds=torch.cat([hidden, first], dim=1), use_cache=True)
        cache = _read_now(out.cache)
        base = frame_index * self.groups  # [B, 1]
        residual = self.predictor_sampler(out.logits[:, -1:], base, *sampling)  # [B, 1]: group 1
        residuals = [residual]
        for g in range(1, self.groups - 1):
            cache, residual = self.predict_step(cache, residual, g, base, *sampling)
            residuals.append(residual)
        residual_codes = torch.cat(residuals, dim=1)  # [B, G - 1]
        return torch.cat([code, residual_codes], dim=1).unsqueeze(-1)

    @loop
    def predict_step(
        self,
        cache: Any,
        residual: Tensor,
        g: int,
        base: Tensor,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
    ) -> tuple[Any, Tensor]:
        out = self.predictor_lm(input_ids=residual, cache=cache, use_cache=True, generation_steps=g)
        cache = _read_now(out.cache)
        logits = out.logits[:, -1:]  # [B, 1, V]
        return cache, self.predictor_sampler(logits, base + g, temperature, top_p, top_k, seed)

    @loop
    def decode_chunk(self, chunk: Tensor, n_ctx: int) -> Tensor:
        # A talker that ends at once (its first code is codec EOS) leaves one frame of EOS's
        # residuals, which upstream never decodes: it plays as silence here, not an error.
        valid = (chunk < self.codebook).all(1).all(1)  # [B]
        wav = self.code2wav(chunk.clamp_max(self.codebook - 1))  # [B, 1, samples]
        wav = wav * valid.view(-1, 1, 1)  # exact for valid rows (x * 1.0 == x)
        return wav[..., n_ctx * self.upsample :]  # the context's samples dropped

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        return None
