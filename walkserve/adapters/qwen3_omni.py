"""Qwen3-Omni (``transformers.Qwen3OmniMoeForConditionalGeneration``) as walks: thinker ->
talker (with its multi-token code predictor) -> code2wav, streamed stage to stage.

The upstream thinker, talker, code predictor and code2wav are used unmodified, as components;
this module writes the loops that upstream ``generate()`` hides, around their forward methods,
and reproduces what ``generate()`` feeds the talker. What crosses its boundary: walk inputs
``input_ids`` [1, P] int64 (a chat prompt ending with ``<|im_start|> assistant \\n``),
``max_new_tokens`` (thinker), ``max_audio_tokens`` (talker, counted as upstream
``talker_max_new_tokens``) and ``speaker_id`` (a codec speaker id from
``config.talker_config.speaker_id``), the sampling inputs (below, all with greedy defaults);
for audio input (walks ``chat_audio``, ``speak_audio``)
also ``input_features`` [1, mel, T] float and ``feature_attention_mask`` [1, T] int64, for an
image (``chat_image``, ``speak_image``) ``pixel_values`` [patches, C * T * p * p] float and
``image_grid_thw`` [1, 3] int64, with the prompt's placeholders laid out as upstream's
processor does (``audio_chat_prompt``, ``image_request``); outputs ``first_token`` [1, 1]
(t0, from the prefill), ``text_tokens`` [1, n - 1] (t1 .. t{n-1}, streamed token by token),
``codes`` [1, G, frames] and ``waveform`` [1, 1, samples] (both streamed).

Media: the thinker's prefill takes the encoder inputs (its own audio / vision towers run
inside it); the talker's prefill puts ``hidden_projection`` of the thinker prefill's
``accept_hidden_layer`` states at the media placeholders (``TalkerPrompt``). Images move the
rotary positions of thinker and talker (``MropePositions``, from upstream ``get_rope_index``);
upstream keeps that offset on the modules (``rope_deltas``), the walks carry it per request
into every decode step (``step_positions``), so no request reads another's state.

    thinker  prefill -> t0; decode t1 .. t{n-1} (EOS / max_new_tokens)
             feeds:   t1 t2 ... t{n-2} <eos>            (the item of the last token is the
                                                         tts_eos marker, as generate() builds
                                                         ``trailing_text_hidden``)
    talker   prefill(user text, assistant header, t0, speaker) -> c0
             per feed item (stream, FixedChunk(1)): one talker step; on the <eos> item, more
             steps on tts_pad until codec EOS / max_audio_tokens. Each step first runs the code
             predictor (G - 1 residual codes of the previous code) as a nested loop, then the
             talker on sum(code embeddings) + text feed -> the next code.
    code2wav stream(codes, LeftContext(L=25, C=300)) (upstream ``chunked_decode`` sizes):
             chunk i decodes frames [max(0, 300 i - 25), 300 (i + 1)) and drops the context's
             samples, so the joined waveform equals ``code2wav.chunked_decode(codes, 300, 25)``.

Greedy by default: equal to upstream ``generate(..., thinker_do_sample=False,
talker_do_sample=False, talker_repetition_penalty=r)`` with the walk input
``talker_repetition_penalty`` = r (default 1). Sampling (``speech_sampling``): per-request inputs
with greedy defaults, ``temperature`` / ``top_p`` / ``top_k`` (thinker), ``talker_*`` (talker),
``predictor_*`` (code predictor) and one ``seed``; each of the three samplers draws its own
stream seeded by ``(seed, row, step)``, so a request's tokens do not depend on its batch
(upstream's draws, from the global RNG, are not reproduced). Not reproduced: video input (and
audio in video), several clips or images in one prompt, audio and image in one request,
batches of several rows in one request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.speech_sampling import SamplingDefaults, TokenSampler
from walkserve.capture import (
    FixedChunk,
    Input,
    LeftContext,
    iterations,
    loop,
    mark_component,
    register_component,
    stream,
    walk,
)

if TYPE_CHECKING:
    from walkserve.api.profile import ModelProfile

# What the walks take beyond the sample request's shapes: prompts of any length; audio
# features [1, mel, T] and their mask [1, T] of any length T (images: pixel_values
# [patches, dim] and image_grid_thw [images, 3] vary along dimension 0, which is free).
SEQUENCE = Input(dims={1: "dynamic"})
AUDIO_INPUTS = {
    "input_ids": SEQUENCE,
    "input_features": Input(dims={2: "dynamic"}),
    "feature_attention_mask": SEQUENCE,
}

# Feed item ids that are not thinker tokens (the thinker vocabulary is >= 0).
FEED_EOS = -1  # the tts_eos marker after the last spoken text token
FEED_PAD = -2  # tts_pad: the talker speaks on after the text ended
MAX_TALKER_STEPS = 4096  # upstream talker_max_new_tokens default; the per-request bound is an input
MAX_THINKER_STEPS = 32768

# Upstream generate()'s sampling (transformers 5.24 ``Qwen3OmniMoeForConditionalGeneration.
# generate`` defaults; the code predictor's top_k / top_p are fixed in the talker's forward, its
# temperature is its generation config's), for a profile to send; the walks default to greedy.
# The thinker samples as its checkpoint's generation_config.json says (not known here).
TALKER_SAMPLING = SamplingDefaults(temperature=0.9, top_p=1.0, top_k=50, repetition_penalty=1.05)
PREDICTOR_SAMPLING = SamplingDefaults(temperature=1.0, top_p=0.8, top_k=50)
GREEDY = (0.0, 1.0, 0, 0)  # (temperature, top_p, top_k, seed)


@dataclass(frozen=True)
class OmniTokens:
    """The special token ids the talker's input is built from (upstream config fields)."""

    im_start: int
    assistant: int
    user: int
    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int

    @staticmethod
    def of(config: Any) -> OmniTokens:
        t = config.talker_config
        return OmniTokens(
            config.im_start_token_id,
            config.assistant_token_id,
            config.user_token_id,
            config.tts_bos_token_id,
            config.tts_eos_token_id,
            config.tts_pad_token_id,
            t.codec_nothink_id,
            t.codec_think_bos_id,
            t.codec_think_eos_id,
            t.codec_pad_id,
            t.codec_bos_id,
            t.codec_eos_token_id,
        )


def _read_now(value: Any) -> Any:
    """``value`` (an attribute of a component's structured output, e.g. its KV cache), read at
    this point of the walk. While capturing, fx records an attribute read lazily, at its first
    use; a cache's first use is often the next loop, after unrelated glue, and the read would
    join that glue's node, on that node's rank. Reading it here keeps it in the component's own
    dispatch, on the rank where the object lives. A no-op in eager execution."""
    if isinstance(value, torch.fx.Proxy):
        _ = value.node  # creates the getattr node now
    return value


class TalkerText(nn.Module):
    """Thinker token ids -> the talker's text input: ``text_projection(embed_tokens(ids))``;
    feed ids ``FEED_EOS`` / ``FEED_PAD`` map to the tts_eos / tts_pad embeddings."""

    def __init__(self, embed: nn.Module, projection: nn.Module, tokens: OmniTokens) -> None:
        super().__init__()
        self.embed, self.projection, self.tokens = embed, projection, tokens

    def forward(self, ids: Tensor) -> Tensor:  # ids: [B, S] -> [B, S, D_talker]
        ids = torch.where(ids == FEED_EOS, self.tokens.tts_eos, ids)
        ids = torch.where(ids == FEED_PAD, self.tokens.tts_pad, ids)
        return self.projection(self.embed(ids))


def user_mask(input_ids: Tensor, tok: OmniTokens) -> Tensor:
    """[B, P] bool: the tokens of user turns (from a user turn's ``<|im_start|>`` up to the next
    ``<|im_start|>``), which upstream ``generate()`` hands the talker."""
    length = input_ids.shape[1]
    positions = torch.arange(length, device=input_ids.device)
    starts = torch.where(input_ids == tok.im_start, positions, -1)
    role_at = torch.cummax(starts, dim=-1).values.clamp_min(0) + 1
    roles = input_ids.gather(1, role_at.clamp_max(length - 1))
    user = roles == tok.user  # [B, P]
    if not bool((user.sum(-1) == user[0].sum()).all()):
        raise ValueError("rows of one request need the same number of user tokens")
    return user


TALKER_HEADER = 9  # assistant header + codec control tokens + t0 in the talker's prefill


class MropePositions(nn.Module):
    """Multimodal rotary positions of a prompt with images: upstream ``get_rope_index`` of the
    thinker (on the prompt) or of the talker (on the talker's prefill ids: the user tokens,
    then ``TALKER_HEADER`` tts_pad ids, as ``generate()`` lays them out). Upstream keeps the
    resulting offset on the module (``rope_deltas``) for its decode steps; here it is returned
    and carried by the walk's decode loop, so concurrent requests never share it.

    -> ``position_ids`` [4, B, S] (the text row 0 .. S-1, then the t / h / w rows) and ``rope``
    [B, 2]: the last position of the text row and of the t / h / w rows; decode step k (k = 1
    for the first token after the prefill) is at ``rope + k`` (``step_positions``)."""

    def __init__(self, owner: nn.Module, talker_tokens: OmniTokens | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # the thinker or talker; not a submodule
        self.talker_tokens = talker_tokens

    def forward(self, input_ids: Tensor, image_grid_thw: Tensor) -> tuple[Tensor, Tensor]:
        # input_ids: [B, P], image_grid_thw: [images, 3] -> ([4, B, S], [B, 2])
        ids = input_ids
        if self.talker_tokens is not None:
            user = user_mask(input_ids, self.talker_tokens)
            user_ids = input_ids[user].view(input_ids.shape[0], -1)  # [B, U]
            pad = user_ids.new_full((ids.shape[0], TALKER_HEADER), self.talker_tokens.tts_pad)
            ids = torch.cat([user_ids, pad], dim=1)  # [B, U + 9]
        batch, length = ids.shape
        owner: Any = self.owner
        mrope, _ = owner.get_rope_index(ids, image_grid_thw, None, torch.ones_like(ids))
        text = torch.arange(length, device=ids.device).expand(1, batch, length)
        positions = torch.cat([text, mrope], dim=0)  # [4, B, S]
        return positions, positions[[0, 1], :, -1].t()  # rope: [B, 2]


def step_positions(rope: Tensor, count: Tensor) -> Tensor:
    """``position_ids`` [4, B, 1] of a decode step: ``rope`` [B, 2] (see ``MropePositions``) +
    ``count`` [B, 1] (tokens generated so far, the prefill's included)."""
    at = rope + count  # [B, 2]
    return at[:, [0, 1, 1, 1]].t().unsqueeze(-1)


class TalkerPrompt(nn.Module):
    """The talker's prefill input, as upstream ``generate()`` builds it: the user turns, then
    the assistant header with the codec control tokens and the speaker, ending with the first
    generated text token.

        text:  user tokens ... | <im_start> assistant \\n  pad pad pad pad  tts_bos  t0
        codec:      0     ...  |     0         0      0  nothink think_bos think_eos spk pad bos

    A user token is ``text_projection(embed(id))``; with ``hidden`` (the thinker prefill's
    hidden states of layer ``accept_hidden_layer``), a media placeholder (audio / image /
    video token) is ``hidden_projection(hidden)`` at its position instead.
    """

    def __init__(
        self,
        text: TalkerText,
        codec_embed: nn.Module,
        tokens: OmniTokens,
        hidden_projection: nn.Module | None = None,
        media_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.text, self.codec_embed, self.tokens = text, codec_embed, tokens
        self.hidden_projection, self.media_ids = hidden_projection, media_ids

    def forward(
        self, input_ids: Tensor, first_token: Tensor, speaker_id: int, hidden: Tensor | None = None
    ) -> Tensor:
        # input_ids: [B, P], first_token: [B, 1], hidden: [B, P, D_thinker] -> [B, U + 9, D_talker]
        tok = self.tokens
        batch, length = input_ids.shape
        device = input_ids.device
        user = user_mask(input_ids, tok)  # [B, P]
        header = (input_ids[:, :-1] == tok.im_start) & (input_ids[:, 1:] == tok.assistant)
        if not bool(header[:, length - 3].all()):
            raise ValueError(
                "the prompt must end with the assistant header `<|im_start|> assistant \\n` "
                "(three tokens), as the Qwen3-Omni chat template writes it"
            )
        projected = self.text(input_ids)  # [B, P, D]
        if hidden is not None:
            if self.hidden_projection is None:
                raise ValueError("this TalkerPrompt was built without a hidden_projection")
            media = torch.isin(input_ids, torch.tensor(self.media_ids, device=device))  # [B, P]
            projected = projected.clone()
            projected[media] = self.hidden_projection(hidden[media]).to(projected.dtype)
        user_part = projected[user].view(batch, -1, projected.shape[-1])  # [B, U, D]
        specials = self.text(torch.tensor([[tok.tts_bos, tok.tts_eos, tok.tts_pad]], device=device))
        bos, _, pad = specials.chunk(3, dim=1)  # 3 x [1, 1, D]
        head = self.text(torch.cat([input_ids[:, -3:], first_token], dim=1))  # [B, 4, D]
        text_part = torch.cat(
            [head[:, :3], pad.expand(batch, 4, -1), bos.expand(batch, -1, -1), head[:, 3:]], dim=1
        )  # [B, 9, D]
        codec_ids = torch.tensor(
            [
                [
                    tok.codec_nothink,
                    tok.codec_think_bos,
                    tok.codec_think_eos,
                    speaker_id,
                    tok.codec_pad,
                    tok.codec_bos,
                ]
            ],
            device=device,
        ).expand(batch, -1)
        codec_part = torch.cat(
            [text_part.new_zeros(batch, 3, text_part.shape[-1]), self.codec_embed(codec_ids)],
            dim=1,
        )  # [B, 9, D]
        return torch.cat([user_part, text_part + codec_part], dim=1)


def audio_token_count(frames: int | Tensor, n_window: int) -> Tensor:
    """The number of audio placeholder tokens (= audio encoder outputs) for ``frames`` mel
    frames (an int, or a tensor of counts): upstream's own length formula
    (``_get_feat_extract_output_lengths``), as an int64 tensor of the same shape."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as upstream

    count: Tensor = upstream._get_feat_extract_output_lengths(torch.as_tensor(frames), n_window)
    return count


class AudioPlaceholders(nn.Module):
    """Checks that each row of a prompt holds as many audio placeholder tokens as the audio
    encoder makes of its features (``feature_attention_mask`` counts the frames); returns the
    prompt unchanged. Upstream would otherwise scatter the features out of place or fail deep
    inside the thinker."""

    def __init__(self, audio_token: int, n_window: int) -> None:
        super().__init__()
        self.audio_token, self.n_window = audio_token, n_window

    def forward(self, input_ids: Tensor, feature_attention_mask: Tensor) -> Tensor:
        # input_ids: [B, P], feature_attention_mask: [B, T] -> input_ids
        if feature_attention_mask.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"{feature_attention_mask.shape[0]} audio feature rows for {input_ids.shape[0]} "
                "prompt rows: give one audio per prompt row"
            )
        want = audio_token_count(feature_attention_mask.sum(-1), self.n_window)  # [B]
        have = (input_ids == self.audio_token).sum(-1)  # [B]
        if not bool((want == have).all()):
            raise ValueError(
                f"the prompt holds {have.tolist()} audio placeholder tokens but the audio "
                f"encoder makes {want.tolist()} of the given features: lay the prompt out as "
                "<|audio_start|> + audio_token_count(frames) x <|audio_pad|> + <|audio_end|>"
            )
        return input_ids


class ImagePlaceholders(nn.Module):
    """Checks one image per prompt row, as many image placeholder tokens in the row as the
    vision encoder makes of its patch grid (t * h * w / merge^2), and ``pixel_values`` holding
    every patch; returns the prompt unchanged."""

    def __init__(self, image_token: int, merge: int) -> None:
        super().__init__()
        self.image_token, self.merge = image_token, merge

    def forward(self, input_ids: Tensor, pixel_values: Tensor, image_grid_thw: Tensor) -> Tensor:
        # input_ids: [B, P], pixel_values: [patches, C * T * p * p], image_grid_thw: [B, 3]
        if image_grid_thw.shape != (input_ids.shape[0], 3):
            raise ValueError(
                f"image_grid_thw has shape {tuple(image_grid_thw.shape)}; give one (t, h, w) "
                f"row per prompt row ({input_ids.shape[0]}), one image each"
            )
        patches = image_grid_thw.prod(-1)  # [B]
        if int(patches.sum()) != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values holds {pixel_values.shape[0]} patches but image_grid_thw says "
                f"{int(patches.sum())}"
            )
        want = patches // self.merge**2
        have = (input_ids == self.image_token).sum(-1)
        if not bool((want == have).all()):
            raise ValueError(
                f"the prompt holds {have.tolist()} image placeholder tokens but the vision "
                f"encoder makes {want.tolist()} of the given grid: lay the prompt out as "
                "<|vision_start|> + t*h*w/merge^2 x <|image_pad|> + <|vision_end|>"
            )
        return input_ids


class StepInput(nn.Module):
    """One talker decode input: the sum of a code frame's embeddings (the talker's own codec
    embedding for group 0, the code predictor's for groups 1 .. G-1) plus the text feed."""

    def __init__(self, codec_embed: nn.Module, residual_embeds: nn.ModuleList, text: TalkerText):
        super().__init__()
        self.codec_embed, self.residual_embeds, self.text = codec_embed, residual_embeds, text

    def forward(self, frame: Tensor, feed: Tensor) -> Tensor:
        # frame: [B, G, 1] int64, feed: [B, 1] -> [B, 1, D_talker]
        parts = [self.codec_embed(frame[:, 0])]  # [B, 1, D]
        parts += [emb(frame[:, g + 1]) for g, emb in enumerate(self.residual_embeds)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True) + self.text(feed)


def _speak_sampling(
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    talker_temperature: float,
    talker_top_p: float,
    talker_top_k: int,
    predictor_temperature: float,
    predictor_top_p: float,
    predictor_top_k: int,
    talker_repetition_penalty: float,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The speech walks' sampling inputs as ``_speak`` takes them: the thinker's
    ``(temperature, top_p, top_k, seed)``, then the talker's ``(temperature, top_p, top_k, seed,
    repetition_penalty)`` followed by the code predictor's ``(temperature, top_p, top_k)``."""
    talker = (talker_temperature, talker_top_p, talker_top_k, seed, talker_repetition_penalty)
    predictor = (predictor_temperature, predictor_top_p, predictor_top_k)
    return (temperature, top_p, top_k, seed), (*talker, *predictor)


class Qwen3OmniWalks(nn.Module):
    """Walks ``chat`` (thinker only) and ``speak`` (thinker -> talker -> code2wav) around an
    upstream ``Qwen3OmniMoeForConditionalGeneration``."""

    def __init__(
        self,
        model: Any,
        thinker_eos_id: int,
        chunk_size: int = 300,
        left_context: int = 25,
        first_chunk: int | None = None,
    ) -> None:
        super().__init__()
        if not getattr(model, "has_talker", False):
            raise ValueError("the model has no talker: load it with enable_audio_output=True")
        register_component(type(model.thinker), engine="kv_cache")
        register_component(type(model.talker), engine="kv_cache", speculative=False)
        register_component(type(model.talker.code_predictor), engine="kv_cache", speculative=False)
        register_component(type(model.code2wav), engine="stateless")
        for cls in (
            TalkerText,
            TalkerPrompt,
            StepInput,
            AudioPlaceholders,
            ImagePlaceholders,
            MropePositions,
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
        """``chat`` with one audio clip per prompt row: log-mel ``input_features`` [B, mel, T]
        and ``feature_attention_mask`` [B, T] (1 = a real frame), the prompt holding
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
        """``chat`` with one image per prompt row: ``pixel_values`` [patches, C * T * p * p] and
        ``image_grid_thw`` [B, 3] as upstream's image processor makes them, the prompt holding
        t * h * w / merge^2 image placeholders between vision start and end."""
        input_ids = self.image_placeholders(input_ids, pixel_values, image_grid_thw)
        media = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        sampling = (temperature, top_p, top_k, seed)
        first, text_tokens, _, _ = self._think(input_ids, max_new_tokens, media, sampling=sampling)
        return {"first_token": first, "text_tokens": text_tokens}

    def _think(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        media: Mapping[str, Tensor] | None = None,
        hidden: bool = False,
        sampling: tuple[Any, ...] = GREEDY,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """-> t0 [B, 1], the decode loop's tokens t1 .. t{n-1} [B, n - 1] (a streamed channel),
        the talker's feed items [B, n - 1], and with ``hidden`` the prefill's hidden states of
        layer ``accept_hidden_layer`` [B, P, D] (for the talker's media positions). ``media``:
        the thinker's encoder inputs, given to the prefill. ``sampling``: the thinker's
        ``(temperature, top_p, top_k, seed)``. Every decode step gets explicit positions from
        ``rope`` [B, 2], a per-request loop input (``MropePositions``): with images the
        multimodal positions of the prompt; else (text, audio: plain positions upstream) the
        prompt's last position. Nothing is read from upstream's ``rope_deltas`` module
        attribute, which concurrent requests would share."""
        extra: dict[str, Any] = dict(media or {})
        if "image_grid_thw" in extra:
            positions = self.thinker_positions(input_ids, extra["image_grid_thw"])
            extra["position_ids"] = positions[0]  # [4, B, P]
        if hidden:
            extra["output_hidden_states"] = True
        out = self.thinker(input_ids=input_ids, use_cache=True, **extra)
        cache = _read_now(out.cache)
        accepted = out.hidden_states[self.accept_layer] if hidden else None  # [B, P, D]
        first = token = self.thinker_sampler(out.logits[:, -1:], 0, *sampling)  # [B, 1]: t0
        count = token * 0 + 1  # [B, 1] (elementwise: runs in the thinker's dispatch)
        if "position_ids" in extra:
            rope = positions[1]  # [B, 2]
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
        out = self.thinker(input_ids=token, cache=cache, use_cache=True, position_ids=positions)
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
        """``speak`` with one audio clip per prompt row (inputs as in ``chat_audio``)."""
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
        """``speak`` with one image per prompt row (inputs as in ``chat_image``)."""
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
            positions = self.talker_positions(input_ids, media["image_grid_thw"])
            extra["position_ids"] = positions[0]  # [4, B, U + 9]
        out = self.talker(inputs_embeds=prompt, use_cache=True, output_hidden_states=True, **extra)
        cache = _read_now(out.cache)
        hidden = out.hidden_states[0][-1][:, -1:]  # [B, 1, D]: last layer, last position
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
        out = self.talker(
            inputs_embeds=embeds,
            cache=cache,
            use_cache=True,
            position_ids=step_positions(rope, count),  # [4, B, 1]
            output_hidden_states=True,
            generation_step=0,  # only echoed back (+1) by the upstream forward
        )
        cache = _read_now(out.cache)
        hidden = out.hidden_states[0][-1][:, -1:]  # [B, 1, D]
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
        predictor = self.talker.code_predictor
        out = predictor(inputs_embeds=torch.cat([hidden, first], dim=1), use_cache=True)
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
        out = self.talker.code_predictor(
            input_ids=residual, cache=cache, use_cache=True, generation_steps=g
        )
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


# ---------------------------------------------------------------------- instances

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
    a prompt with an image and then audio placeholders, audio features and pixels. The audio
    placeholders stand without audio start / end tokens, so that the image walks (which give
    no audio features) read them as text, in their positions too; the audio walks read the
    image placeholders as text."""
    image = image_request(config, grid_hw, seed=1, newline=newline)
    audio = audio_request(config, frames, user_ids, newline=newline)
    thinker = config.thinker_config
    clip = int(audio_token_count(frames, thinker.audio_config.n_window))
    ids = image["input_ids"][0, :-5].tolist()  # up to <|vision_end|>
    ids += [thinker.audio_token_id] * clip
    return {
        **audio,
        **image,
        "input_ids": chat_prompt(config, [*ids[2:], *user_ids], newline),
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
    walks = Qwen3OmniWalks(model, tiny_eos(model, prompt), TINY_CHUNK, TINY_CONTEXT, first_chunk)
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
    walks = Qwen3OmniWalks(model, int(model.config.im_end_token_id))
    vocab = int(model.config.thinker_config.text_config.vocab_size)
    hello, newline = (9707, 198) if vocab > 9707 else (vocab // 2, 9)  # Qwen tokenizer ids
    sample = {
        **media_sample(model.config, 160, (4, 4), [hello], newline=newline),
        "max_new_tokens": 8,
        "max_audio_tokens": 32,
        "speaker_id": int(speakers[speaker.lower()]),
    }
    return walks, sample


# ---------------------------------------------------------------------- HTTP profiles
# (``/v1/chat/completions`` text and audio, ``/v1/audio/speech``: see ``adapters.omni_http``)


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

    images = cm.tiny_image_processor(config.thinker_config.vision_config)
    return cm.with_qwen3_chat_media(profile, config, extractor, images, TINY_AUDIO_SECONDS)


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
    from walkserve.adapters import omni_chatmedia as cm

    images = cm.checkpoint_image_processor(path, config.thinker_config.vision_config)
    return cm.with_qwen3_chat_media(profile, config, extractor, images, CHECKPOINT_AUDIO_SECONDS)


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
