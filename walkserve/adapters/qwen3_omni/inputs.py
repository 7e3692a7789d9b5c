"""The inputs Qwen3-Omni's decoders are fed, built as upstream ``generate()`` builds them: the
special token ids (``OmniTokens``), the talker's text feed (``TalkerText``) and prefill
(``TalkerPrompt``), the multimodal rotary positions carried per request (``MropePositions``,
``step_positions``), the checks of media placeholders, a talker step's input (``StepInput``),
and the walks' constants (feed markers, loop bounds, sampling defaults)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.speech_sampling import SamplingDefaults
from walkserve.capture import (
    Input,
)

if TYPE_CHECKING:
    pass

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

    def forward(
        self,
        input_ids: Tensor,
        image_grid_thw: Tensor,
        feature_attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        # input_ids: [B, P], image_grid_thw: [images, 3], feature_attention_mask: [clips, T]
        # (audio clips in the prompt too: their lengths) -> ([4, B, S], [B, 2])
        ids = input_ids
        if self.talker_tokens is not None:
            user = user_mask(input_ids, self.talker_tokens)
            user_ids = input_ids[user].view(input_ids.shape[0], -1)  # [B, U]
            pad = user_ids.new_full((ids.shape[0], TALKER_HEADER), self.talker_tokens.tts_pad)
            ids = torch.cat([user_ids, pad], dim=1)  # [B, U + 9]
        batch, length = ids.shape
        owner: Any = self.owner
        seqlens = None if feature_attention_mask is None else feature_attention_mask.sum(-1)
        mrope, _ = owner.get_rope_index(
            ids, image_grid_thw, None, torch.ones_like(ids), audio_seqlens=seqlens
        )
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


def placeholder_runs(input_ids: Tensor, token: int) -> list[int]:
    """The lengths of the runs of ``token`` in ``input_ids`` [B, P], row by row, in order: one
    run per media item (each between its start and end tokens), so that the items of requests
    batched along dimension 0 stay in the order of their rows."""
    runs: list[int] = []
    for row in (input_ids == token).tolist():
        for hit, group in itertools.groupby(row):
            if hit:
                runs.append(len(list(group)))
    return runs


class AudioPlaceholders(nn.Module):
    """Checks that a prompt holds one run of audio placeholder tokens per clip (row of
    ``feature_attention_mask``, in order), each as long as the audio encoder makes of the
    clip's frames; returns the prompt unchanged. Upstream would otherwise scatter the features
    out of place or fail deep inside the thinker."""

    def __init__(self, audio_token: int, n_window: int) -> None:
        super().__init__()
        self.audio_token, self.n_window = audio_token, n_window

    def count(self, frames: Tensor) -> Tensor:
        """The encoder's tokens for each clip's ``frames`` [clips] (another Omni's formula in a
        subclass)."""
        return audio_token_count(frames, self.n_window)

    def forward(self, input_ids: Tensor, feature_attention_mask: Tensor) -> Tensor:
        # input_ids: [B, P], feature_attention_mask: [clips, T] -> input_ids
        have = placeholder_runs(input_ids, self.audio_token)
        if feature_attention_mask.shape[0] != len(have):
            raise ValueError(
                f"{feature_attention_mask.shape[0]} audio feature rows for {len(have)} runs of "
                "audio placeholders in the prompt: give one feature row per clip"
            )
        want = self.count(feature_attention_mask.sum(-1)).tolist()
        if want != have:
            raise ValueError(
                f"the prompt holds {have} audio placeholder tokens but the audio "
                f"encoder makes {want} of the given features: lay the prompt out as audio "
                "start + one audio placeholder per encoder token (the count of the clip's "
                "frames) + audio end"
            )
        return input_ids


class ImagePlaceholders(nn.Module):
    """Checks one run of image placeholder tokens per image (row of ``image_grid_thw``, in
    order), each as long as the vision encoder makes of its patch grid (t * h * w / merge^2),
    and ``pixel_values`` holding every patch; returns the prompt unchanged. With ``kind``
    "video" the same of videos (``video_grid_thw``, ``pixel_values_videos``)."""

    def __init__(self, image_token: int, merge: int, kind: str = "image") -> None:
        super().__init__()
        self.image_token, self.merge, self.kind = image_token, merge, kind

    def forward(self, input_ids: Tensor, pixel_values: Tensor, image_grid_thw: Tensor) -> Tensor:
        # input_ids: [B, P], pixel_values: [patches, C * T * p * p], image_grid_thw: [images, 3]
        have = placeholder_runs(input_ids, self.image_token)
        kind = self.kind
        grid, values = f"{kind}_grid_thw", "pixel_values" + ("_videos" if kind == "video" else "")
        if image_grid_thw.dim() != 2 or image_grid_thw.shape != (len(have), 3):
            raise ValueError(
                f"{grid} has shape {tuple(image_grid_thw.shape)}; give one (t, h, w) "
                f"row per {kind} ({len(have)} runs of {kind} placeholders in the prompt)"
            )
        patches = image_grid_thw.prod(-1)  # [images]
        if int(patches.sum()) != pixel_values.shape[0]:
            raise ValueError(
                f"{values} holds {pixel_values.shape[0]} patches but {grid} says "
                f"{int(patches.sum())}"
            )
        want = (patches // self.merge**2).tolist()
        if want != have:
            raise ValueError(
                f"the prompt holds {have} {kind} placeholder tokens but the vision "
                f"encoder makes {want} of the given grid: lay the prompt out as "
                f"<|vision_start|> + t*h*w/merge^2 x <|{kind}_pad|> + <|vision_end|>"
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
