"""example-speech: thinker -> talker -> codec, a text-to-speech pipeline with two streams.

One walk, ``speak(prompt_ids, max_new_tokens) -> text_tokens, codes, waveform``, in three stages:

1. **thinker** (causal LM, ``kv_cache``): prefills the prompt, then decodes greedily until EOS
   (a DynamicLoop bounded by ``max_new_tokens``). Each step emits a text token and the hidden
   state of the token it read; the hidden states accumulate into ``hidden`` [B, n, D_think].
2. **talker** (causal LM, ``kv_cache``): consumes ``stream(hidden, FixedChunk(1))``: one step
   per thinker hidden state, which it projects to its own width and adds to the embedding of
   its previous codec token; one greedy codec token per step, accumulated into ``codes`` [B, n].
3. **codec** (``stateless``): consumes ``stream(codes, LeftContext(2, 3))``: each chunk holds up
   to 2 frames of left context and 3 new frames; the decoder turns ``L + C`` frames into
   ``(L + C) * HOP`` samples and the consumer drops the context's ``n_ctx * HOP`` samples.

    thinker  t0 -> t1 -> t2 -> ... -> EOS      hidden:  h0 h1 h2 ... h{n-1}   (h_i reads t_i)
    talker          c0    c1    c2 ... c{n-1}  (c_i from h_i and c_{i-1})
    codec    [|c0 c1 c2] [c1 c2|c3 c4 c5] ...   -> waveform [B, n * HOP]

The codec's convolution is causal with a receptive field of ``CODEC_CONTEXT + 1`` frames, so
chunked decoding with ``LeftContext(CODEC_CONTEXT, ...)`` reproduces a decode of the whole
sequence.

EOS: random weights never learn to end a turn, so ``build`` picks the thinker's EOS id from its
own greedy decode of the sample prompt: the first token, at step 4 or later (counting from 0),
that the decode has not emitted before. The sample request therefore stops after a handful of
steps (5 to 12 with default settings), well before ``max_new_tokens``, and the choice is
deterministic in the seed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from walkserve.adapters.examples.blocks import (
    CausalLM,
    StackConfig,
    TransformerStack,
    empty_kv,
    init_weights,
    seeded,
)
from walkserve.capture.api import component, iterations, loop, stream, walk
from walkserve.capture.chunk import FixedChunk, LeftContext

THINKER_VOCAB = 64
THINKER_CONFIG = StackConfig(dim=48, layers=2, heads=4)
TALKER_CONFIG = StackConfig(dim=32, layers=2, heads=4)
CODEBOOK = 32  # codec token ids 0 .. CODEBOOK - 1
CODEC_BOS = CODEBOOK  # the talker's "no previous code" input id (never emitted)
CODEC_DIM = 32
HOP = 64  # waveform samples per codec frame
CODEC_CONTEXT = 2  # LeftContext L: frames of left context per chunk
CODEC_CHUNK = 3  # LeftContext C: new frames per chunk
INIT_STD = 0.15
PROMPT_LEN = 6
MAX_NEW_TOKENS = 16
EOS_FIRST_STEP = 4  # EOS is picked at this decode step or later (see the module docstring)
EOS_LAST_STEP = 11


@component(engine="kv_cache")
class Thinker(CausalLM):
    """tokens [B, S], past_k/v [layers, B, H, T, hd]
    -> logits [B, S, V], hidden [B, S, D], new_k/v (T + S)."""

    def forward(
        self, tokens: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.run(tokens, past_k, past_v)


@component(engine="kv_cache")
class Talker(nn.Module):
    """thinker hidden [B, S, D_think], previous codes [B, S], past_k/v [layers, B, H, T, hd]
    -> code logits [B, S, CODEBOOK], new_k/v (T + S)."""

    def __init__(self, thinker_dim: int, cfg: StackConfig, codebook: int) -> None:
        super().__init__()
        self.proj = nn.Linear(thinker_dim, cfg.dim)
        self.code_embed = nn.Embedding(codebook + 1, cfg.dim)  # + CODEC_BOS
        self.stack = TransformerStack(cfg)
        self.head = nn.Linear(cfg.dim, codebook, bias=False)

    def forward(
        self, hidden: Tensor, prev_codes: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        x = self.proj(hidden) + self.code_embed(prev_codes)  # [B, S, D_talk]
        h, new_k, new_v = self.stack(x, past_k, past_v)
        return self.head(h), new_k, new_v


@component(engine="stateless")
class CodecDecoder(nn.Module):
    """codes [B, L] int64 -> waveform [B, L * hop] in [-1, 1]. A causal convolution over
    ``context + 1`` frames, then a linear map from each frame to ``hop`` samples."""

    def __init__(self, codebook: int, dim: int, hop: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(codebook, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=context + 1)
        self.out = nn.Linear(dim, hop)

    def forward(self, codes: Tensor) -> Tensor:
        x = self.embed(codes).transpose(1, 2)  # [B, E, L]
        x = F.gelu(self.conv(F.pad(x, (self.context, 0))))  # causal: frame i sees i-ctx .. i
        wav = torch.tanh(self.out(x.transpose(1, 2)))  # [B, L, hop]
        return wav.flatten(1)  # [B, L * hop]


class SpeechModel(nn.Module):
    """Text prompt -> text reply, codec tokens and waveform, streamed stage to stage."""

    def __init__(self, eos_id: int = 1) -> None:
        super().__init__()
        self.thinker_cfg, self.talker_cfg = THINKER_CONFIG, TALKER_CONFIG
        self.eos_id = eos_id
        self.thinker = Thinker(THINKER_VOCAB, THINKER_CONFIG)
        self.talker = Talker(THINKER_CONFIG.dim, TALKER_CONFIG, CODEBOOK)
        self.codec = CodecDecoder(CODEBOOK, CODEC_DIM, HOP, CODEC_CONTEXT)

    @walk
    def speak(self, prompt_ids: Tensor, max_new_tokens: int) -> dict[str, Tensor]:
        # prompt_ids: [B, P] int64
        # 1. thinker: prefill the prompt, then greedy decode until EOS.
        think_k, think_v = empty_kv(self.thinker_cfg, prompt_ids)  # [layers, B, H, 0, hd]
        logits, _, think_k, think_v = self.thinker(prompt_ids, think_k, think_v)  # [B, P, V]
        token = logits[:, -1:].argmax(dim=-1)  # [B, 1]: t0
        first_token = token
        tokens: list[Tensor] = []
        hiddens: list[Tensor] = []
        for _ in iterations(max_new_tokens):
            think_k, think_v, token, hidden, done = self.think_step(think_k, think_v, token)
            tokens.append(token)
            hiddens.append(hidden)
            if done:
                break
        text_tokens = torch.cat([first_token, torch.cat(tokens, dim=1)], dim=1)  # [B, 1 + n]
        thinker_hidden = torch.cat(hiddens, dim=1)  # [B, n, D_think]

        # 2. talker: one step per thinker hidden state, as each arrives.
        talk_k, talk_v = empty_kv(self.talker_cfg, prompt_ids)
        code = prompt_ids.new_full((prompt_ids.shape[0], 1), CODEC_BOS)  # [B, 1]
        code_list: list[Tensor] = []
        for h in stream(thinker_hidden, FixedChunk(1), dim=1):  # h: [B, 1, D_think]
            talk_k, talk_v, code = self.talk_step(talk_k, talk_v, code, h)
            code_list.append(code)
        codes = torch.cat(code_list, dim=1)  # [B, n]

        # 3. codec: chunks of CODEC_CHUNK new frames after up to CODEC_CONTEXT context frames.
        pieces: list[Tensor] = []
        for chunk, n_ctx in stream(codes, LeftContext(CODEC_CONTEXT, CODEC_CHUNK), dim=1):
            pieces.append(self.decode_chunk(chunk, n_ctx))
        waveform = torch.cat(pieces, dim=-1)  # [B, n * HOP]
        return {"text_tokens": text_tokens, "codes": codes, "waveform": waveform}

    @loop(max_iters="max_new_tokens")
    def think_step(
        self, k_cache: Tensor, v_cache: Tensor, token: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        logits, hidden, k_cache, v_cache = self.thinker(token, k_cache, v_cache)  # [B, 1, *]
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        done = (token == self.eos_id).all()  # 0-d bool
        return k_cache, v_cache, token, hidden, done

    @loop
    def talk_step(
        self, k_cache: Tensor, v_cache: Tensor, code: Tensor, hidden: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        logits, k_cache, v_cache = self.talker(hidden, code, k_cache, v_cache)  # [B, 1, CODEBOOK]
        code = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        return k_cache, v_cache, code

    @loop
    def decode_chunk(self, chunk: Tensor, n_ctx: int) -> Tensor:
        wav = self.codec(chunk)  # [B, (n_ctx + new) * HOP]
        return wav[..., n_ctx * HOP :]  # [B, new * HOP]: the context's samples dropped


def _pick_eos(model: SpeechModel, prompt_ids: Tensor) -> int:
    """The thinker's first greedy token at a step in [EOS_FIRST_STEP, EOS_LAST_STEP] that it has
    not emitted at an earlier step; falls back to a token it never emits (no early stop)."""
    model.eos_id = -1  # no id matches: decode runs the full EOS_LAST_STEP + 1 steps
    out = model.speak(prompt_ids, EOS_LAST_STEP + 1)
    emitted = out["text_tokens"][0, 1:].tolist()  # the loop's tokens, step 0 first
    for step in range(EOS_FIRST_STEP, len(emitted)):
        if emitted[step] not in emitted[:step]:
            return int(emitted[step])
    unused = sorted(set(range(THINKER_VOCAB)) - set(emitted))
    return unused[0]


def build(seed: int = 0) -> tuple[SpeechModel, dict[str, Any]]:
    """The model with seeded random weights and a calibrated EOS id (see the module docstring),
    and the inputs of a sample request."""
    with seeded(seed):
        model = SpeechModel()
        init_weights(model, INIT_STD)
        prompt_ids = torch.randint(0, THINKER_VOCAB, (1, PROMPT_LEN))  # [1, P]
    model.eval().requires_grad_(False)
    model.eos_id = _pick_eos(model, prompt_ids)
    return model, {"prompt_ids": prompt_ids, "max_new_tokens": MAX_NEW_TOKENS}
