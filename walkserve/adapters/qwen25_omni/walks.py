"""``Qwen25OmniWalks``: the walk ``speak`` (thinker -> talker -> token2wav) around an upstream
``Qwen2_5OmniForConditionalGeneration``, its thinker and talker on the paged KV pool
(``decoders``), and ``SeededToken2Wav``; the media walks are ``media_walks``'. See the package
docstring for the flow."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.qwen3_omni.inputs import ImagePlaceholders, _read_now
from walkserve.adapters.qwen25_omni.decoders import TalkerOnPool, ThinkerOnPool
from walkserve.adapters.qwen25_omni.media_walks import (
    Qwen25AudioPlaceholders,
    RopePositions,
)
from walkserve.adapters.qwen25_omni.video_walk import VideoRopePositions, VideoWalk
from walkserve.adapters.speech_sampling import SamplingDefaults, TokenSampler
from walkserve.capture import (
    FixedChunk,
    Input,
    iterations,
    loop,
    register_component,
    stream,
    walk,
)
from walkserve.capture.api import component
from walkserve.runtime.kv.paged_lm import PagedLMConfig

MAX_TALKER_STEPS = 4096
MAX_THINKER_STEPS = 32768

# Upstream generate()'s talker sampling (transformers 5.24 ``Qwen2_5OmniForConditionalGeneration.
# generate`` defaults), for a profile to send; the walks default to greedy (temperature 0).
TALKER_SAMPLING = SamplingDefaults(temperature=0.9, top_p=0.8, top_k=40, repetition_penalty=1.05)


@component(engine="stateless", speculative=False)
class SeededToken2Wav(nn.Module):
    """Upstream ``token2wav`` (DiT flow matching from random noise, then BigVGAN) made
    deterministic per request: it runs under a forked global RNG seeded with the request's
    ``seed`` (``torch.manual_seed(seed)`` just before upstream's own call gives the same
    waveform), with the conditioning and reference mel of the speaker whose text bos token the
    request names (``model.speaker_map[speaker]``: ``bos_token``, ``cond``, ``ref_mel``).

    ``codes`` [B, m]: the talker's tokens; each row is cut at its first codec EOS / pad, as
    upstream ``generate()`` does, and rows are decoded one after another under one seeding
    (as ``generate()`` does for a batch). Out: waveform [B, 1, samples] float32."""

    def __init__(
        self, token2wav: nn.Module, speaker_map: Mapping[str, Any], codec_eos: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.token2wav = token2wav
        self.codec_eos = codec_eos
        self.speakers: dict[int, str] = {}
        for name, params in speaker_map.items():
            bos = int(params["bos_token"])
            if bos in self.speakers:
                raise ValueError(
                    f"speakers {self.speakers[bos]!r} and {name!r} share text bos token {bos}: "
                    "the walk names its speaker by that token"
                )
            self.speakers[bos] = name
            cond = params["cond"].float().expand(1, -1).clone()  # [1, C], as generate() expands
            ref_mel = params["ref_mel"].float().expand(1, -1, -1).clone()  # [1, T, M]
            self.register_buffer(f"cond_{bos}", cond, persistent=False)
            self.register_buffer(f"ref_mel_{bos}", ref_mel, persistent=False)

    def forward(self, codes: Tensor, text_bos_id: int, seed: int) -> Tensor:
        # codes: [B, m] int64 -> [B, 1, samples] float32
        if int(text_bos_id) not in self.speakers:
            raise ValueError(
                f"text_bos_id {text_bos_id} names no speaker; the speakers by bos token: "
                f"{self.speakers}"
            )
        cond: Tensor = getattr(self, f"cond_{int(text_bos_id)}")  # [1, C]
        ref_mel: Tensor = getattr(self, f"ref_mel_{int(text_bos_id)}")  # [1, T, M]
        eos = torch.isin(codes, torch.tensor(self.codec_eos, device=codes.device))  # [B, m]
        positions = torch.arange(codes.shape[1], device=codes.device)
        lengths = torch.where(eos, positions, codes.shape[1]).min(dim=1).values.tolist()
        device = codes.device
        devices = [device.index or 0] if device.type == "cuda" else []
        rows = []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(int(seed))
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(int(seed))
            for b, length in enumerate(lengths):
                if length == 0:
                    rows.append(cond.new_zeros(0))
                    continue
                wav = self.token2wav(
                    codes[b : b + 1, :length], conditioning=cond, reference_mel=ref_mel
                )
                rows.append(wav.reshape(-1).float())
        if any(r.shape != rows[0].shape for r in rows):
            raise ValueError("rows of one request decode to different lengths; send one row")
        return torch.stack(rows).unsqueeze(1)

    def forward_batch(self, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> list[Tensor]:
        """Each request on its own: its noise depends on its seed only, not on its batch."""
        return [self(*args, **kwargs) for args, kwargs in calls]


class Qwen25OmniWalks(VideoWalk, nn.Module):
    """Walks ``speak`` (thinker -> talker) and, from ``MediaWalks``, ``chat_audio``,
    ``chat_image`` and ``chat_media`` (thinker only; ``speak_*`` with the talker), from
    ``VideoWalk`` ``chat_video``, around an upstream ``Qwen2_5OmniForConditionalGeneration``."""

    def __init__(self, model: Any, thinker_eos_id: int, pool: PagedLMConfig | None = None) -> None:
        """``pool``: the thinker's and the talker's KV pools (the server's settings override
        it)."""
        super().__init__()
        register_component(ThinkerOnPool, engine="kv_cache")
        register_component(TalkerOnPool, engine="kv_cache", speculative=False)
        for cls in (Qwen25AudioPlaceholders, ImagePlaceholders, RopePositions, VideoRopePositions):
            register_component(cls, engine="stateless")
        object.__setattr__(self, "upstream", model)  # for reference runs; not a submodule
        self.thinker: Any = model.thinker
        self.talker: Any = model.talker
        self.eos = thinker_eos_id
        self.codec_eos = (int(model.talker.codec_pad_token), int(model.talker.codec_eos_token))
        self.codec_bos = int(model.talker.codec_bos_token)
        self.text_eos = int(model.talker.text_eos_token)
        self.text_pad = int(model.talker.text_pad_token)
        suppressed = torch.zeros(int(model.talker.codebook_size), dtype=torch.bool)
        suppressed[self.codec_bos] = True  # generate() suppresses the codec bos token
        self.suppressed: Tensor
        self.register_buffer("suppressed", suppressed, persistent=False)
        prompt_ids = torch.zeros(1, int(model.talker.codebook_size), dtype=torch.bool)
        talker = model.talker
        prompt_ids[0, [talker.codec_mask_token, talker.codec_pad_token, self.codec_bos]] = True
        self.talker_prompt_ids: Tensor  # [1, V_talker]: the ids of generate()'s talker prompt
        self.register_buffer("talker_prompt_ids", prompt_ids, persistent=False)
        self.thinker_sampler = TokenSampler(stream=0)
        self.talker_sampler = TokenSampler(stream=1)
        self.token2wav = SeededToken2Wav(model.token2wav, model.speaker_map, self.codec_eos)
        # The decoders on the paged pool: concurrent requests share their forwards.
        self.thinker_lm = ThinkerOnPool(model.thinker, pool)
        self.talker_lm = TalkerOnPool(model.talker, pool)
        thinker_config = model.config.thinker_config
        self.audio_placeholders = Qwen25AudioPlaceholders(int(thinker_config.audio_token_index))
        merge = int(thinker_config.vision_config.spatial_merge_size)
        self.image_placeholders = ImagePlaceholders(int(thinker_config.image_token_index), merge)
        self.thinker_positions = RopePositions(model.thinker)
        video_token = int(thinker_config.video_token_index)
        self.video_placeholders = ImagePlaceholders(video_token, merge, kind="video")
        self.video_positions = VideoRopePositions(model.thinker)

    @walk(inputs={"input_ids": Input(dims={1: "dynamic"})})
    def speak(
        self,
        input_ids: Tensor,
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
        thinker_sampling = (temperature, top_p, top_k, seed)
        talker_sampling: tuple[Any, ...] = (talker_temperature, talker_top_p, talker_top_k, seed)
        talker_sampling += (talker_repetition_penalty,)
        # 1. thinker prefill, and the step feeding t0 (its hidden state primes the talker).
        out = self.thinker_lm(input_ids=input_ids, use_cache=True, output_hidden_states=True)
        cache = _read_now(out.cache)
        prompt_part = out.hidden_states[-1] + out.hidden_states[0]  # [B, P, D]
        first = self.thinker_sampler(out.logits[:, -1:], 0, *thinker_sampling)  # [B, 1]: t0
        out = self.thinker_lm(
            input_ids=first, cache=cache, use_cache=True, output_hidden_states=True
        )
        cache = _read_now(out.cache)
        reply0 = out.hidden_states[-1] + out.hidden_states[0]  # [B, 1, D]
        token = second = self.thinker_sampler(out.logits[:, -1:], 1, *thinker_sampling)  # t1
        count = token * 0 + 2
        tokens, replies = [], []
        for _ in iterations(max_new_tokens):
            cache, token, count, reply, done = self.think_step(
                cache, token, count, max_new_tokens, *thinker_sampling
            )
            tokens.append(token)
            replies.append(reply)
            if done:
                break
        text_tokens = torch.cat(tokens, dim=1)  # [B, n - 2]
        reply_items = torch.cat(replies, dim=1)  # [B, n - 2, D + 1]: reply, last flag
        thought = {"first_token": first, "second_token": second, "text_tokens": text_tokens}
        return self._speak(
            thought,
            prompt_part,
            reply0,
            reply_items,
            text_bos_id,
            max_audio_tokens,
            talker_sampling,
        )

    def _speak(
        self,
        thought: dict[str, Tensor],
        prompt_part: Tensor,
        reply0: Tensor,
        reply_items: Tensor,
        text_bos_id: int,
        max_audio_tokens: int,
        talker_sampling: tuple[Any, ...],
    ) -> dict[str, Tensor]:
        """The talker and token2wav after the thinker (``speak`` and the media walks):
        ``thought`` the thinker's outputs (``first_token`` [B, 1], ...), ``prompt_part``
        [B, P, D] the talker's prompt term of the prompt's rows (last hidden state + input
        embedding), ``reply0`` [B, 1, D] that of t0, ``reply_items`` [B, n - 2, D + 1] those of
        the later reply tokens with the last flag. ``talker_sampling``: ``(temperature, top_p,
        top_k, seed, repetition_penalty)``. Out: ``thought`` with ``first_code``, ``codes`` and
        ``waveform``."""
        first = thought["first_token"]
        seed = talker_sampling[3]
        # 2. talker prefill on the prompt, the speaker's text bos and reply0.
        embed = self.thinker.get_input_embeddings()
        zero = first * 0  # [B, 1]
        specials = torch.cat([zero + text_bos_id, zero + self.text_eos, zero + self.text_pad], 1)
        bos_embed, eos_embed, pad_embed = embed(specials).chunk(3, dim=1)  # 3 x [1, 1, D]
        prompt = torch.cat([prompt_part, bos_embed, reply0], dim=1)  # [B, P + 2, D]
        # generate() drops the talker's all-ones attention mask, so the talker forward never
        # computes rotary positions of its own (default positions) nor adds the codec bos /
        # pad embeddings (it does both only with a mask).
        talk = self.talker_lm(inputs_embeds=prompt, use_cache=True)
        talk_cache = _read_now(talk.cache)
        # The codec ids generate() penalizes (talker repetition_penalty): its talker prompt's
        # (codec mask, pad, bos), then each generated one. seen: [B, V_talker] bool
        seen = torch.zeros_like(talk.logits[:, -1], dtype=torch.bool) | self.talker_prompt_ids
        code = self._pick_code(talk.logits[:, -1:], 0, talker_sampling, seen)  # [B, 1]: c0
        seen = seen.scatter(1, code, True)
        first_code, codes, n_codes = code, [], code * 0 + 1
        for item in stream(reply_items, FixedChunk(1), dim=1):  # item: [B, 1, D + 1]
            talk_cache, code, n_codes, seen, new, stop = self.talk_item(
                talk_cache,
                code,
                n_codes,
                seen,
                item,
                eos_embed,
                pad_embed,
                max_audio_tokens,
                *talker_sampling,
            )
            codes.append(new)
            if stop:
                break
        later_codes = torch.cat(codes, dim=1)  # [B, m - 1]

        # 3. token2wav on the whole code sequence (not streamed: see the package docstring).
        waveform = self.token2wav(torch.cat([first_code, later_codes], 1), text_bos_id, seed)
        return {
            **thought,
            "first_code": first_code,
            "codes": later_codes,
            "waveform": waveform,  # [B, 1, samples]
        }

    def _pick_code(
        self, logits: Tensor, step: Tensor | int, sampling: tuple[Any, ...], seen: Tensor
    ) -> Tensor:
        masked = logits.masked_fill(self.suppressed, float("-inf"))  # [B, 1, V]
        return self.talker_sampler(masked, step, *sampling, seen)  # [B, 1]

    def _ended(self, code: Tensor, n_codes: Tensor, limit: int) -> Tensor:
        return (code == self.codec_eos[0]) | (code == self.codec_eos[1]) | (n_codes >= limit)

    @loop(max_iters="max_new_tokens")
    def think_step(
        self,
        cache: Any,
        token: Tensor,
        count: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor]:
        out = self.thinker_lm(
            input_ids=token, cache=cache, use_cache=True, output_hidden_states=True
        )
        cache = _read_now(out.cache)
        reply = out.hidden_states[-1] + out.hidden_states[0]  # [B, 1, D]: of the token fed
        logits = out.logits[:, -1:]  # [B, 1, V]
        token = self.thinker_sampler(logits, count, temperature, top_p, top_k, seed)  # [B, 1]
        count = count + 1
        last = (token == self.eos) | (count >= max_new_tokens)  # [B, 1]
        item = torch.cat([reply, last.unsqueeze(-1).to(reply.dtype)], dim=-1)  # [B, 1, D + 1]
        return cache, token, count, item, last.all()

    @loop(max_iters=MAX_THINKER_STEPS, speculative=False)
    def talk_item(
        self,
        cache: Any,
        code: Tensor,
        n_codes: Tensor,
        seen: Tensor,
        item: Tensor,
        eos_embed: Tensor,
        pad_embed: Tensor,
        limit: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        repetition_penalty: float,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The talker steps of one reply item: one, or after the last item's step, more on the
        text-EOS, then text-pad embedding until the talker ends."""
        k = n_codes * 0  # steps taken for this item
        new = []
        sampling = (temperature, top_p, top_k, seed, repetition_penalty)
        for _ in range(MAX_TALKER_STEPS):
            cache, code, n_codes, seen, k, stop = self.talk_step(
                cache, code, n_codes, seen, k, item, eos_embed, pad_embed, limit, *sampling
            )
            new.append(code)
            if stop:
                break
        done = self._ended(code, n_codes, limit).all()
        return cache, code, n_codes, seen, torch.cat(new, dim=1), done

    @loop(max_iters=MAX_TALKER_STEPS, speculative=False)
    def talk_step(
        self,
        cache: Any,
        code: Tensor,
        n_codes: Tensor,
        seen: Tensor,
        k: Tensor,
        item: Tensor,
        eos_embed: Tensor,
        pad_embed: Tensor,
        limit: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        repetition_penalty: float,
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor, Tensor]:
        reply, last = item[..., :-1], item[..., -1:] > 0  # [B, 1, D], [B, 1, 1]
        after = torch.where(k.unsqueeze(-1) == 1, eos_embed, pad_embed)  # [B, 1, D]
        feed = torch.where(k.unsqueeze(-1) == 0, reply, after)
        out = self.talker_lm(input_ids=code, thinker_reply_part=feed, cache=cache, use_cache=True)
        cache = _read_now(out.cache)
        sampling = (temperature, top_p, top_k, seed, repetition_penalty)
        code = self._pick_code(out.logits[:, -1:], n_codes, sampling, seen)
        n_codes = n_codes + 1
        ended = self._ended(code, n_codes, limit)  # [B, 1]
        stop = (ended | ~last[..., 0]).all()  # a reply item gets one step, the last one more
        return cache, code, n_codes, seen.scatter(1, code, True), k + 1, stop

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        return None
