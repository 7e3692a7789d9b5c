"""example-text: a tiny causal language model served as two walks, prefill then decode.

    prefill(prompt_ids)                              -> token, k_cache, v_cache, position
    decode(token, k_cache, v_cache, max_new_tokens)  -> tokens

``prefill`` runs the whole prompt through the LM once, from an empty cache, and picks the first
new token greedily. Its KV cache is request state (``state=("k_cache", "v_cache")``) that the
``decode`` walk receives by name. ``decode`` is a DynamicLoop: one LM forward per token, greedy
argmax, stopping after the step that produces EOS or after ``max_new_tokens`` steps.

    prompt  p0 p1 ... p{P-1} | t0        (t0: prefill's token, at position P)
    decode                    t0 -> t1 -> t2 -> ... -> EOS   (tokens = [t1, t2, ..., EOS])

The weights are random (seeded): std 0.15 for the linear layers and unit-scale token embeddings,
so that greedy decoding wanders over the vocabulary instead of repeating one token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from walkserve.adapters.examples.blocks import CausalLM, StackConfig, empty_kv, init_weights, seeded
from walkserve.capture.api import Input, component, iterations, loop, walk

VOCAB = 96
EOS_ID = 2
LM_CONFIG = StackConfig(dim=48, layers=2, heads=4)
INIT_STD = 0.15
PROMPT_LEN = 8
MAX_NEW_TOKENS = 16
KV_CACHE = Input(dims={1: "dynamic", 3: "dynamic"})  # [layers, B, H, T, hd]: batch, length


@component(engine="kv_cache")
class TextLM(CausalLM):
    """tokens [B, S], past_k/v [layers, B, H, T, hd] -> logits [B, S, V], new_k/v (T + S)."""

    def forward(
        self, tokens: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        logits, _, new_k, new_v = self.run(tokens, past_k, past_v)
        return logits, new_k, new_v


class TextModel(nn.Module):
    """Greedy text generation with an explicit KV cache, in two walks."""

    def __init__(
        self, vocab: int = VOCAB, cfg: StackConfig = LM_CONFIG, eos_id: int = EOS_ID
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.eos_id = eos_id
        self.lm = TextLM(vocab, cfg)

    @walk(next="decode", state=("k_cache", "v_cache"))
    def prefill(self, prompt_ids: Tensor) -> dict[str, Tensor]:
        # prompt_ids: [B, P] int64
        k_cache, v_cache = empty_kv(self.cfg, prompt_ids)  # [layers, B, H, 0, hd]
        logits, k_cache, v_cache = self.lm(prompt_ids, k_cache, v_cache)  # [B, P, V]; T = P
        token = logits[:, -1:].argmax(dim=-1)  # [B, 1] int64
        position = prompt_ids.new_full((prompt_ids.shape[0],), prompt_ids.shape[1])  # [B]: P
        return {"token": token, "k_cache": k_cache, "v_cache": v_cache, "position": position}

    @walk(inputs={"k_cache": KV_CACHE, "v_cache": KV_CACHE})
    def decode(
        self, token: Tensor, k_cache: Tensor, v_cache: Tensor, max_new_tokens: int
    ) -> dict[str, Tensor]:
        # token: [B, 1]; k_cache, v_cache: [layers, B, H, T, hd]
        tokens: list[Tensor] = []
        for _ in iterations(max_new_tokens):
            k_cache, v_cache, token, done = self.decode_step(k_cache, v_cache, token)
            tokens.append(token)
            if done:
                break
        return {"tokens": torch.cat(tokens, dim=1)}  # [B, n], n <= max_new_tokens

    @loop(max_iters="max_new_tokens")
    def decode_step(
        self, k_cache: Tensor, v_cache: Tensor, token: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        logits, k_cache, v_cache = self.lm(token, k_cache, v_cache)  # [B, 1, V]; T grows by 1
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        done = (token == self.eos_id).all()  # 0-d bool: every sequence emitted EOS
        return k_cache, v_cache, token, done


def build(seed: int = 0) -> tuple[TextModel, dict[str, Any]]:
    """The model with seeded random weights, and the inputs of a sample request (the prefill
    walk's ``prompt_ids`` and the decode walk's ``max_new_tokens``)."""
    with seeded(seed):
        model = TextModel()
        init_weights(model, INIT_STD)
        prompt_ids = torch.randint(EOS_ID + 1, VOCAB, (1, PROMPT_LEN))  # [1, P], no EOS
    model.eval().requires_grad_(False)
    return model, {"prompt_ids": prompt_ids, "max_new_tokens": MAX_NEW_TOKENS}
