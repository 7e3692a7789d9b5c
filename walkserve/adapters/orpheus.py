"""Orpheus-style text-to-speech: an unmodified ``transformers.LlamaForCausalLM`` emits SNAC code
tokens, seven per audio frame, which stream into an unmodified ``snac.SNAC`` decoder (its weight
norm folded into its weights once, ``fold_weight_norm``: the same weights). The LM
runs on the paged KV engine (``runtime.kv.paged_lm.PagedLM``), as the text walks' LMs do, so
concurrent requests' decode steps share one forward.

Owns: the walks around the two upstream models, the SNAC decoder as a component
(``SnacFrames``), the factories ``tiny`` and ``bench`` (their random pairs are built in
``orpheus_tiny``), a loader for local checkpoints (``load_orpheus``) and the speech task's HTTP
profiles with Orpheus's voices. The token layout (which ids are SNAC codes, how a frame's seven
codes go to SNAC's three levels, the prompt) lives in ``orpheus_tokens``. What crosses the
boundary: walk inputs ``input_ids`` [B, P] int64 (an Orpheus prompt, see ``orpheus_prompt``),
``max_new_tokens`` (int) and, with defaults, ``temperature`` (0: greedy), ``top_p``, ``top_k``,
``seed`` and ``repetition_penalty`` (1: off; drawn by ``PagedLM``); outputs ``tokens`` [B, n]
int64 (greedy: exactly ``generate(do_sample=False)``'s new tokens, with the same
``repetition_penalty``) and ``waveform`` [B, samples] float32 at the SNAC sample rate (24 kHz).

Streaming (Orpheus's own streaming decoder): once 28 audio tokens (4 frames) exist and then
after every further 7, the last 4 frames are decoded and only the second frame's audio,
samples ``[S, 2S)`` of the window's ``4S`` (``S`` = samples per frame, 2048 at 24 kHz), is
played. Here that is ``stream(tokens, SlidingWindow(28, 7))``: window ``i`` holds tokens
``[7i, 7i + 28)`` and contributes ``S`` samples, so waveform samples ``[iS, (i+1)S)`` are
``snac.decode(window i)[S:2S]``: the audio of frame ``i + 1`` with one frame of left and two of
right context. Orpheus plays neither frame 0 nor the last two frames.

End-of-stream rule: ``pad`` with ``pad_value=-1`` (never a valid token). A window with any token
that is not an audio code of its position (the end-of-speech token, the padding, or a wrongly
placed token) decodes to silence (zeros), where Orpheus's decoder skips it; its codes are
clamped into the codebook only so that the batched decode can run. The padded final fragment is
therefore always silent, so the audio equals Orpheus's chunks followed by at most one silent
chunk. Why not ``drop`` (what Orpheus does): a loop that runs zero times has no value in the
Walk Graph, so a request that ends before 28 tokens would fail instead of returning silence.

Decoding starts from the prompt's last token (Orpheus prompts end with ``start_of_speech``):
the walk prefills ``input_ids[:, :-1]`` and the first loop step reads the last prompt token, so
every new token, the first included, comes out of one loop and streams on one edge.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from walkserve.adapters.orpheus_tiny import (
    BENCH_CONFIG,
    BENCH_TOKENS,
    TINY_CONFIG,
    TINY_TOKENS,
    RandomConfig,
    random_pair,
)
from walkserve.adapters.orpheus_tokens import (
    FRAME,
    LEVEL_POSITIONS,
    ORPHEUS_TOKENS,
    OrpheusTokens,
    orpheus_prompt,
)
from walkserve.adapters.speech_sampling import SamplingDefaults
from walkserve.capture import Input, iterations, loop, register_component, stream, walk
from walkserve.capture.api import component
from walkserve.capture.chunk import EndOfStream, SlidingWindow
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

register_component(PagedLM, engine="kv_cache")

if TYPE_CHECKING:
    from walkserve.api.profile import ModelProfile

WINDOW_FRAMES = 4  # frames decoded per streamed chunk (28 tokens)
KEPT_FRAME = 1  # the window's frame whose audio is played
PAD_TOKEN = -1  # pads the final fragment; never a valid token
# Orpheus's own inference defaults (its engine's ``generate_tokens_sync``), for a profile to send;
# the walk defaults to greedy (temperature 0, no repetition penalty).
ORPHEUS_SAMPLING = SamplingDefaults(temperature=0.6, top_p=0.8, repetition_penalty=1.3)


def fold_weight_norm(snac: nn.Module) -> nn.Module:
    """``snac`` with its weight-normalized convolutions' weights computed once and stored
    (``remove_parametrizations(leave_parametrized=True)``), in place, instead of recomputed
    from their ``g`` and ``v`` on every ``decode``: the same weights bit for bit, so the same
    audio. Upstream SNAC recomputes all of them per call; for the streamed 4-frame windows
    that was 12% of a decode on CPU (py-spy, ``bench``'s snac_24khz-shaped decoder). Its
    ``state_dict`` then holds plain ``weight`` keys (``load_snac`` reads both layouts)."""
    from torch.nn.utils import parametrize

    for module in snac.modules():
        if parametrize.is_parametrized(module):
            parametrized: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
            for name in list(parametrized.keys()):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return snac


@component(engine="stateless")
class SnacFrames(nn.Module):
    """Orpheus frames of audio token ids [B, F, 7] -> waveform [B, F * S] through an unmodified
    ``snac.SNAC`` (``S = hop_length * vq_strides[0]`` samples per frame), and a validity flag
    [B, 1]: every token is an audio code of its frame position. Invalid codes are clamped into
    the codebook (the flag says the audio means nothing)."""

    def __init__(self, snac: Any, tokens: OrpheusTokens) -> None:  # snac.SNAC (untyped)
        super().__init__()
        if list(snac.vq_strides) != [4, 2, 1]:
            raise ValueError(f"Orpheus needs SNAC vq_strides [4, 2, 1], got {snac.vq_strides}")
        if int(snac.codebook_size) != tokens.codebook:
            raise ValueError(
                f"SNAC codebook_size {snac.codebook_size} != the LM's codebook {tokens.codebook}"
            )
        self.snac = snac
        self.tokens = tokens
        self.samples_per_frame = int(snac.hop_length) * 4
        positions = torch.arange(FRAME) * tokens.codebook + tokens.audio_offset  # [7]
        self.offsets: Tensor
        self.register_buffer("offsets", positions, persistent=False)

    def forward(self, frames: Tensor) -> tuple[Tensor, Tensor]:
        codes = frames - self.offsets  # [B, F, 7]
        valid = ((codes >= 0) & (codes < self.tokens.codebook)).flatten(1).all(1, keepdim=True)
        codes = codes.clamp(0, self.tokens.codebook - 1)
        levels = [codes[:, :, list(p)].flatten(1) for p in LEVEL_POSITIONS]  # [B, F * (1|2|4)]
        wav = self.snac.decode(levels)  # [B, 1, F * S]
        return wav[:, 0].float(), valid  # [B, F * S], [B, 1]


class OrpheusTTS(nn.Module):
    """Walks ``speak`` (prompt -> tokens and streamed waveform) and ``decode`` (whole frames ->
    waveform, not streamed) around an upstream Llama LM and SNAC decoder.

    The LM runs inside ``PagedLM`` (the paged KV engine of the text walks): a worker packs every
    running request's decode step into one forward, and KV memory is paged, shared by prefix
    and preempted like text requests'. ``lm`` is the upstream model itself; its attention is
    routed to the pool, so compare against ``reference_lm(model)``, a copy on SDPA."""

    def __init__(
        self, lm: Any, snac: Any, tokens: OrpheusTokens, kv: PagedLMConfig | None = None
    ) -> None:
        super().__init__()
        if lm.config.vocab_size < tokens.vocab_end:
            raise ValueError(
                f"LM vocab_size {lm.config.vocab_size} does not hold the audio tokens "
                f"(ids up to {tokens.vocab_end - 1})"
            )
        self.lm = PagedLM(lm, kv)
        self.codec = SnacFrames(snac, tokens)
        self.tokens = tokens
        self.eos = tokens.end_of_speech
        self.samples_per_frame = self.codec.samples_per_frame
        self.sample_rate = int(getattr(snac, "sampling_rate", 24000))

    @property
    def upstream_lm(self) -> Any:
        """The upstream ``LlamaForCausalLM`` (its attention goes to the paged pool)."""
        return self.lm.lm

    @walk(  # input_ids: P >= 2 ids of the upstream LM's vocabulary
        inputs={
            "input_ids": Input(
                dims={1: (2, None)},
                vocab=lambda m: m.upstream_lm.get_input_embeddings().num_embeddings,
            )
        }
    )
    def speak(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        repetition_penalty: float = 1.0,
    ) -> dict[str, Tensor]:
        # input_ids: [B, P], P >= 2, ending with start_of_speech. The prefill's own token (after
        # P - 1 tokens) is not used: the first step reads the prompt's last token.
        _, cache = self.lm(input_ids[:, :-1], None, 0)
        token = input_ids[:, -1:]  # [B, 1]
        count = torch.zeros_like(token)
        # PagedLM samples (seeded by (seed, row, step)) and applies the repetition penalty to
        # the ids generate() penalizes: the prompt's, then each new one.
        sampling = (temperature, top_p, top_k, seed, repetition_penalty)
        new: list[Tensor] = []
        for _ in iterations(max_new_tokens):
            token, cache, count = self.step(token, cache, count, *sampling)
            new.append(token)
            if ((token == self.eos) | (count >= max_new_tokens)).all():
                break
        tokens = torch.cat(new, dim=1)  # [B, n]
        windows = SlidingWindow(
            WINDOW_FRAMES * FRAME, FRAME, end=EndOfStream.PAD, pad_value=PAD_TOKEN
        )
        pieces: list[Tensor] = []
        for window in stream(tokens, windows, dim=1):  # window: [B, 28]
            pieces.append(self.play_window(window))
        return {"tokens": tokens, "waveform": torch.cat(pieces, dim=-1)}  # waveform: [B, k * S]

    @loop
    def step(
        self,
        token: Tensor,
        cache: Any,
        count: Tensor,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        repetition_penalty: float,
    ) -> tuple[Tensor, Any, Tensor]:
        sampling = (temperature, top_p, top_k, seed, repetition_penalty)
        token, cache = self.lm(token, cache, count, *sampling)  # [B, 1]
        return token, cache, count + 1

    @loop
    def play_window(self, window: Tensor) -> Tensor:
        wav, valid = self.codec(window.unflatten(1, (WINDOW_FRAMES, FRAME)))  # [B, 4S], [B, 1]
        s = self.samples_per_frame
        return wav[:, KEPT_FRAME * s : (KEPT_FRAME + 1) * s] * valid  # [B, S]

    @walk(inputs={"frames": Input(dims={1: "dynamic"})})
    def decode(self, frames: Tensor) -> dict[str, Tensor]:
        # frames: [B, F, 7] audio token ids (``audio_frames``)
        wav, _ = self.codec(frames)
        return {"waveform": wav}  # [B, F * S]


def reference_lm(model: OrpheusTTS) -> Any:
    """A copy of ``model``'s upstream LM on transformers' SDPA attention: what ``generate()``
    is called on for reference outputs (the model's own LM attends through the paged pool)."""
    import copy

    lm = copy.deepcopy(model.upstream_lm)
    lm.set_attn_implementation("sdpa")
    return lm


def build(config: RandomConfig = TINY_CONFIG, seed: int = 0) -> OrpheusTTS:
    """A random LM and SNAC of ``config``'s sizes (``orpheus_tiny.random_pair``: the LM steered
    to emit frames) in the walks, the SNAC's weight norm folded."""
    lm, snac = random_pair(config, seed)
    model = OrpheusTTS(lm, fold_weight_norm(snac), config.tokens).eval()
    model.requires_grad_(False)
    return model


def sample_inputs(tokens: OrpheusTokens, max_new_tokens: int) -> dict[str, Any]:
    """A five-token text prompt for ``speak``; four frames of code 0 for ``decode``."""
    text = list(range(72, 77))
    zero_codes = torch.arange(FRAME) * tokens.codebook + tokens.audio_offset  # [7]
    return {
        "input_ids": torch.tensor([orpheus_prompt(text, tokens)]),  # [1, P]
        "max_new_tokens": max_new_tokens,
        "frames": zero_codes.repeat(1, WINDOW_FRAMES, 1),  # [1, 4, 7]
    }


def tiny() -> tuple[OrpheusTTS, dict[str, Any]]:
    """The tiny random instance for tests: ``serve("walkserve.adapters.orpheus:tiny")``."""
    return build(TINY_CONFIG), sample_inputs(TINY_TOKENS, 42)


def speech_profile(
    name: str, tokens: OrpheusTokens, encode_text: Callable[[str], list[int]], sample_rate: int
) -> ModelProfile:
    """What ``/v1/audio/speech`` needs: the ``speak`` walk, its waveform channel, and text
    encoded into an Orpheus prompt."""
    from walkserve.api.profile import ModelProfile, SpeechTask

    def encode(text: str) -> list[int]:
        return orpheus_prompt(encode_text(text), tokens)

    speech = SpeechTask(
        walk="speak",
        prompt_input="input_ids",
        max_tokens_input="max_new_tokens",
        waveform_channel="waveform",
        sample_rate=sample_rate,
        vocab_size=tokens.vocab_end,
        max_prompt_tokens=1024,
        max_tokens_limit=4096,
        default_max_tokens=FRAME * 32,  # 32 frames: ~2.7 s at 24 kHz
        encode=encode,
    )
    return ModelProfile(name, speech=speech)


def tiny_profile(name: str) -> ModelProfile:
    """``tiny``'s speech task; text is UTF-8 bytes (ids 0..255)."""
    profile = speech_profile(name, TINY_TOKENS, lambda text: list(text.encode("utf-8")), 24000)
    return with_voices(profile, default=None)


def bench() -> tuple[OrpheusTTS, dict[str, Any]]:
    """The benchmark's random pair (``BENCH_CONFIG``), for ``benchmarks/bench_speech.py``."""
    return build(BENCH_CONFIG), sample_inputs(BENCH_TOKENS, 42)


def bench_profile(name: str) -> ModelProfile:
    """``bench``'s speech task (UTF-8 bytes, like ``tiny``)."""
    return speech_profile(name, BENCH_TOKENS, lambda text: list(text.encode("utf-8")), 24000)


def load_snac(snac_dir: str) -> Any:
    """A SNAC checkpoint directory: ``config.json`` plus ``model.safetensors`` or
    ``pytorch_model.bin`` (read with ``weights_only=True``), as ``snac.SNAC`` itself lays it
    out (or saved from a folded one), without its hub download; returned folded
    (``fold_weight_norm``)."""
    from snac import SNAC

    config_path = os.path.join(snac_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{snac_dir} has no config.json: expected a SNAC checkpoint directory")
    with open(config_path) as f:
        config = json.load(f)
    try:
        snac = SNAC(**config)
    except TypeError as e:
        raise ValueError(f"{config_path} is not a SNAC config: {e}") from None
    st_path = os.path.join(snac_dir, "model.safetensors")
    bin_path = os.path.join(snac_dir, "pytorch_model.bin")
    if os.path.isfile(st_path):
        from safetensors.torch import load_file

        state = load_file(st_path)
    elif os.path.isfile(bin_path):
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{snac_dir} has neither model.safetensors nor pytorch_model.bin")
    if not any(".parametrizations." in key for key in state):
        fold_weight_norm(snac)  # saved from a folded SNAC (``fold_weight_norm``)
    snac.load_state_dict(state)
    return fold_weight_norm(snac).eval()


def load_orpheus(
    lm_dir: str, snac_dir: str, tokens: OrpheusTokens = ORPHEUS_TOKENS
) -> tuple[OrpheusTTS, dict[str, Any]]:
    """Local checkpoint directories: an Orpheus LM (``from_pretrained``, local files only) and a
    SNAC model (``load_snac``), with sample inputs for capture."""
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(lm_dir, local_files_only=True).eval()
    model = OrpheusTTS(lm, load_snac(snac_dir), tokens).eval()
    model.requires_grad_(False)
    return model, sample_inputs(tokens, 64)


def from_env() -> tuple[OrpheusTTS, dict[str, Any]]:
    """``load_orpheus($ORPHEUS_LM_DIR, $ORPHEUS_SNAC_DIR)``: a zero-argument factory, so that
    ``serve("walkserve.adapters.orpheus:from_env")`` serves a real checkpoint (worker
    processes inherit the environment)."""
    lm_dir, snac_dir = os.environ.get("ORPHEUS_LM_DIR"), os.environ.get("ORPHEUS_SNAC_DIR")
    if not lm_dir or not snac_dir:
        raise ValueError("set ORPHEUS_LM_DIR and ORPHEUS_SNAC_DIR to local checkpoint directories")
    return load_orpheus(lm_dir, snac_dir)


def from_env_profile(name: str) -> ModelProfile:
    """``from_env``'s speech task, with the LM checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    lm_dir = os.environ.get("ORPHEUS_LM_DIR")
    if not lm_dir:
        raise ValueError("set ORPHEUS_LM_DIR to the Orpheus LM checkpoint directory")
    tok = AutoTokenizer.from_pretrained(lm_dir, local_files_only=True)
    snac_dir = os.environ.get("ORPHEUS_SNAC_DIR", "")
    config_path = os.path.join(snac_dir, "config.json")
    rate = 24000
    if os.path.isfile(config_path):
        with open(config_path) as f:
            rate = int(json.load(f).get("sampling_rate", rate))

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=True))

    return with_voices(speech_profile(name, ORPHEUS_TOKENS, encode, rate), default="tara")


# ---------------------------------------------------------------------- voices

#: Orpheus's voices; its prompt text is "{voice}: {text}".
ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


def with_voices(profile: ModelProfile, default: str | None) -> ModelProfile:
    """``profile`` with Orpheus's voices on its speech task: a voice puts ``"{voice}: "``
    before the text. ``default=None``: a request naming no voice gets the bare text (the tiny
    random instances, whose tests predate voices)."""
    from walkserve.api.profile import Voice, Voices

    if profile.speech is None:
        raise ValueError(f"{profile.name} has no speech task to give voices to")
    table = {v: Voice(prefix=f"{v}: ") for v in ORPHEUS_VOICES}
    speech = dataclasses.replace(profile.speech, voices=Voices(table, default))
    return dataclasses.replace(profile, speech=speech)
