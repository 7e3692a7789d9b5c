"""Hugging Face causal LMs (Llama, Qwen2, Qwen3, ...) as two walks: ``prefill`` and ``decode``.

The upstream model is used unmodified, as one ``kv_cache`` component; its ``DynamicCache``
travels as request state from prefill to decode. Greedy decoding here is what
``generate(do_sample=False)`` does: prefill picks the first new token; decode feeds the last
token back until EOS or ``max_new_tokens`` new tokens in all. The walk transition skips decode
when prefill already finished the request.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from walkserve.capture import iterations, loop, register_component, walk


class CausalLMWalks(nn.Module):
    """Walks around ``lm`` (any transformers ``*ForCausalLM``)."""

    def __init__(self, lm: nn.Module, eos_token_id: int) -> None:
        super().__init__()
        register_component(type(lm), engine="kv_cache")
        self.lm = lm
        self.eos = eos_token_id
        # transformers >= 5.2x names the cache argument and output field "cache".
        self.kv = (
            "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
        )

    @walk(next="decode", state=("cache", "count"))
    def prefill(self, input_ids):  # input_ids: [B, T]
        out = self.lm(input_ids=input_ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)  # [B, 1]
        return {"token": token, "cache": getattr(out, self.kv), "count": torch.ones_like(token)}

    @walk
    def decode(self, token, cache, count, max_new_tokens):
        tokens = []
        for _ in iterations(max_new_tokens):
            token, cache, count = self.step(token, cache, count)
            tokens.append(token)
            if ((token == self.eos) | (count >= max_new_tokens)).all():
                break
        return {"tokens": torch.cat(tokens, dim=1)}  # [B, new tokens after the first]

    @loop
    def step(self, token, cache, count):
        out = self.lm(input_ids=token, use_cache=True, **{self.kv: cache})
        return out.logits[:, -1:].argmax(-1), getattr(out, self.kv), count + 1

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        if walk == "prefill":
            done = bool((outputs["token"] == self.eos).all()) or int(request["max_new_tokens"]) <= 1
            return None if done else "decode"
        return None


def load_causal_lm(path: str) -> tuple[CausalLMWalks, dict[str, Any]]:
    """A local checkpoint directory (``from_pretrained`` on a path, safetensors) as walks, with
    sample inputs for capture."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    lm.eval()
    eos = lm.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return CausalLMWalks(lm, int(eos if eos is not None else 0)), {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "max_new_tokens": 4,
    }
