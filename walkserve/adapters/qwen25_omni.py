"""Qwen2.5-Omni (``transformers.Qwen2_5OmniForConditionalGeneration``) as walks: thinker ->
talker, streamed (``FixedChunk(1)``), -> token2wav (not streamed); thinker and talker token for
token equal to upstream ``generate()`` (greedy, text-only input), the waveform equal to
``generate()``'s under the same ``torch.manual_seed``. What crosses its boundary: walk inputs
``input_ids`` [1, P], ``max_new_tokens`` (thinker, >= 3), ``max_audio_tokens`` (talker),
``text_bos_id`` (the speaker's ``bos_token`` from ``model.speaker_map``: it also picks the
speaker's token2wav conditioning and reference mel), and, with defaults, the sampling inputs
``temperature``, ``top_p``, ``top_k`` (thinker), ``talker_temperature``, ``talker_top_p``,
``talker_top_k``, ``talker_repetition_penalty`` (1: off) and ``seed`` (temperature 0: greedy;
see ``speech_sampling``; ``seed`` also seeds token2wav's noise); outputs ``first_token``
[1, 1], ``second_token`` [1, 1], ``text_tokens`` [1, n - 2] (streamed), ``first_code`` [1, 1]
and ``codes`` [1, m - 1] (streamed): the talker's tokens, the final EOS or max-th one included;
``waveform`` [1, 1, samples] float32 at 24 kHz (upstream returns [samples]; here with batch
and channel).

    thinker    prefill -> t0; step feeding t0 -> reply0, t1; loop feeding t1 .. t{n-2}:
               each step emits reply_i = last hidden + input embedding of t_i, flagged if its
               output t{i+1} is the last token (EOS / max_new_tokens)
    talker     prefill(prompt hidden + embeds, speaker bos, reply0) -> c0; one step per
               streamed reply_i; after the flagged one, a step on the text-EOS embedding, then
               steps on the text-pad embedding until a codec EOS / max_audio_tokens (as
               generate() does)
    token2wav  after the talker: the codes up to the first codec EOS, decoded at once by
               ``SeededToken2Wav`` under the request's seed (on the talker's rank)

Not streamed: the waveform. Upstream token2wav is a DiT flow-matching model that starts from
random noise and attends over the *whole* code sequence, then BigVGAN; chunking it would change
its output, so the waveform is the walk's last, non-streamed stage. Its noise comes from the
global RNG upstream: ``SeededToken2Wav`` forks the RNG and seeds it with the request's ``seed``,
so the waveform depends on the request alone, and equals upstream ``generate()``'s when
``torch.manual_seed(seed)`` is called just before ``generate()`` with greedy thinker and talker
(nothing else in ``generate()`` draws from the RNG before token2wav).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.qwen3_omni.inputs import _read_now
from walkserve.adapters.qwen25_omni_pool import TalkerOnPool, ThinkerOnPool
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

if TYPE_CHECKING:
    from walkserve.api.profile import ModelProfile

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


class Qwen25OmniWalks(nn.Module):
    """Walks ``speak`` (thinker -> talker) around an upstream
    ``Qwen2_5OmniForConditionalGeneration``."""

    def __init__(self, model: Any, thinker_eos_id: int, pool: PagedLMConfig | None = None) -> None:
        """``pool``: the thinker's and the talker's KV pools (the server's settings override
        it)."""
        super().__init__()
        register_component(ThinkerOnPool, engine="kv_cache")
        register_component(TalkerOnPool, engine="kv_cache", speculative=False)
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

        # 2. talker prefill on the prompt, the speaker's text bos and reply0.
        embed = self.thinker.get_input_embeddings()
        zero = first * 0  # [B, 1]
        specials = torch.cat([zero + text_bos_id, zero + self.text_eos, zero + self.text_pad], 1)
        bos_embed, eos_embed, pad_embed = embed(specials).chunk(3, dim=1)  # 3 x [1, 1, D]
        prompt = torch.cat([prompt_part, bos_embed, reply0], dim=1)  # [B, P + 2, D]
        # generate() gives the talker no attention mask: default positions, and no codec
        # bos / pad embeddings added by the forward (it adds them only with a mask).
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

        # 3. token2wav on the whole code sequence (not streamed: see the module docstring).
        waveform = self.token2wav(torch.cat([first_code, later_codes], 1), text_bos_id, seed)
        return {
            "first_token": first,
            "second_token": second,
            "text_tokens": text_tokens,
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


def tiny_config() -> Any:
    """A Qwen2.5-Omni config small enough for CPU tests (see ``reference/facts.md``)."""
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    media = dict(audio_token_index=240, image_token_index=241, video_token_index=242)
    media |= dict(audio_start_token_id=243, audio_end_token_id=238)
    text = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters=rope,
        initializer_range=0.15,
        max_position_embeddings=4096,
    )
    thinker = dict(
        text_config=text,
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=32,
            max_source_positions=100,
            n_window=4,
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
            window_size=8,
            fullatt_block_indexes=[0],
        ),
        user_token_id=246,
        vision_start_token_id=244,
        vision_end_token_id=239,
        initializer_range=0.15,
        **media,
    )
    talker = dict(
        vocab_size=128,
        tts_text_start_token_id=253,
        tts_text_end_token_id=254,
        tts_text_pad_token_id=252,
        tts_codec_start_token_id=120,
        tts_codec_end_token_id=121,
        tts_codec_pad_token_id=122,
        tts_codec_mask_token_id=123,
        vision_start_token_id=244,
        vision_end_token_id=239,
        embedding_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_parameters=rope,
        initializer_range=0.15,
        max_position_embeddings=4096,
        **media,
    )
    dit = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ff_mult=2,
        emb_dim=16,
        head_dim=16,
        num_embeds=128,
        mel_dim=16,
        enc_emb_dim=16,
        enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48],
        enc_attention_channels=8,
        enc_se_channels=8,
        block_size=4,
        look_ahead_layers=[1],
        look_backward_layers=[0],
    )
    bigvgan = dict(
        mel_dim=16,
        upsample_initial_channel=128,
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3, 5]],
        upsample_rates=[2, 2, 2, 2, 2, 2],
        upsample_kernel_sizes=[4, 4, 4, 4, 4, 4],
    )
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan),
    )


TINY_SPEAKER_BOS = 250
TINY_SPEAKER_BOS_2 = 248  # "Ethan"


def tiny(seed: int = 0) -> tuple[Qwen25OmniWalks, dict[str, Any]]:
    """Zero-argument factory: the tiny random model as walks, and a sample request. The
    speaker map (normally ``spk_dict.pt``) is made by hand: "Chelsie" and "Ethan"."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from walkserve.adapters.qwen3_omni import chat_prompt

    torch.manual_seed(seed)
    config = tiny_config()
    model = Qwen2_5OmniForConditionalGeneration(config).eval().requires_grad_(False)
    model.speaker_map = {
        "Chelsie": {
            "bos_token": TINY_SPEAKER_BOS,
            "cond": torch.randn(1, 16),
            "ref_mel": torch.randn(1, 30, 16),
        }
    }
    model.speaker_map["Ethan"] = {  # drawn after Chelsie's: her tensors stay as they were
        "bos_token": TINY_SPEAKER_BOS_2,
        "cond": torch.randn(1, 16),
        "ref_mel": torch.randn(1, 24, 16),
    }
    prompt = chat_prompt(_Ids(), [10, 11, 12, 13])
    walks = Qwen25OmniWalks(model, thinker_eos_id=251)  # <|im_end|>
    sample = {
        "input_ids": prompt,
        "max_new_tokens": 12,
        "max_audio_tokens": 30,
        "text_bos_id": TINY_SPEAKER_BOS,
    }
    return walks, sample


def upstream_speech(
    walks: Qwen25OmniWalks, request: Mapping[str, Any], seed: int, speaker: str = "Chelsie"
) -> tuple[Tensor, Tensor, Tensor]:
    """The reference for a ``speak`` request: greedy upstream ``generate()`` after
    ``torch.manual_seed(seed)`` -> (new text tokens [1, n], talker tokens [1, m], waveform
    [samples])."""
    model: Any = walks.upstream
    seen: dict[str, Tensor] = {}
    talker_generate = model.talker.generate

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        seen["codes"] = out = talker_generate(*args, **kwargs)
        return out

    model.talker.generate = spy
    try:
        torch.manual_seed(seed)
        sequences, waveform = model.generate(
            request["input_ids"],
            speaker=speaker,
            thinker_max_new_tokens=request["max_new_tokens"],
            thinker_eos_token_id=walks.eos,
            thinker_do_sample=False,
            talker_max_new_tokens=request["max_audio_tokens"],
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_eos_token_id=list(walks.codec_eos),
        )
    finally:
        del model.talker.generate
    prompt = request["input_ids"].shape[1]
    return sequences[:, prompt:], seen["codes"][:, prompt + 2 :], waveform


class _Ids:
    """The chat-template ids of the tiny config (Qwen2.5-Omni's config does not name them)."""

    im_start_token_id = 250
    im_end_token_id = 251
    user_token_id = 246
    assistant_token_id = 247


def load_qwen25_omni(
    path: str, speaker: str = "Chelsie", thinker_eos_id: int = 151645
) -> tuple[Qwen25OmniWalks, dict[str, Any]]:
    """A local Qwen2.5-Omni checkpoint directory (safetensors and its ``spk_dict.pt``, which
    upstream reads with ``torch.load(weights_only=True)``) as walks; ``<|im_end|>`` ends the
    thinker's reply."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model: Any = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, local_files_only=True)
    model.eval().requires_grad_(False)
    model.token2wav.float()  # as generate() runs it
    if speaker not in model.speaker_map:
        raise ValueError(
            f"unknown speaker {speaker!r}; this checkpoint has {sorted(model.speaker_map)}"
        )
    walks = Qwen25OmniWalks(model, thinker_eos_id)
    vocab = int(model.config.thinker_config.text_config.vocab_size)
    ids = [151644, 872, 9707, 151645, 198, 151644, 77091, 198]  # user: "Hello", assistant
    if max(ids) >= vocab:
        ids = [i % vocab for i in ids]
    sample = {
        "input_ids": torch.tensor([ids]),
        "max_new_tokens": 8,
        "max_audio_tokens": 32,
        "text_bos_id": int(model.speaker_map[speaker]["bos_token"]),
    }
    return walks, sample


# ---------------------------------------------------------------------- HTTP profiles
# (``/v1/chat/completions`` text and audio, ``/v1/audio/speech``: see ``adapters.omni_http``).
# Text chat runs ``speak`` with a one-code talker (the model has no thinker-only walk).

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
    return omni_profile(
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
    return omni_profile(
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
