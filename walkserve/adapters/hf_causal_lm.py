"""Hugging Face causal LMs (Llama, Qwen2, Gemma, GPT-2, Mixtral, ...) as two walks: ``prefill``
and ``decode``.

The upstream model runs unmodified inside one ``kv_cache`` component, chosen at load time
(``hf_engine.text_engine``): ``runtime.kv.paged_lm.PagedLM`` when its attention goes through
transformers' attention-function registry in a way the paged KV pool computes exactly (the
worker that hosts it packs every ready request's prefill or decode step into one forward), else
the fallback ``runtime.kv.hf_cache_lm.HFCacheLM`` (the model's own cache per request: exact,
slower). The cache value (``PagedKV`` or ``HFCache``) travels as request state from prefill to
decode.

    prefill(input_ids, temperature, top_p, top_k, seed)            -> token, cache, count
    decode(token, cache, count, max_new_tokens, temperature, ...)  -> tokens (one per step)

Prefill picks the first new token; decode feeds the last token back until EOS or
``max_new_tokens`` new tokens in all; the walk transition skips decode when prefill already
finished the request. ``temperature == 0`` is what ``generate(do_sample=False)`` does, token for
token; otherwise tokens are drawn with top-p / top-k from a generator seeded by
``(seed, row, step)`` (``PagedLM``'s docstring).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from walkserve.capture import iterations, loop, register_component, walk
from walkserve.runtime.kv.hf_cache_lm import HFCacheLM
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

register_component(PagedLM, engine="kv_cache")
register_component(HFCacheLM, engine="kv_cache")

#: The sampling inputs of the text walks, with the values that mean "greedy".
GREEDY_INPUTS: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


class TextWalks:
    """``prefill`` / ``decode`` walks over ``self.lm`` (a ``PagedLM`` or an ``HFCacheLM``)
    stopping at ``self.eos``: mixed into a model class (``CausalLMWalks``, the built-in default
    model)."""

    lm: PagedLM | HFCacheLM
    eos: int

    @walk(next="decode", state=("cache", "count"))
    def prefill(self, input_ids, temperature, top_p, top_k, seed):  # input_ids: [B, T]
        token, cache = self.lm(input_ids, None, 0, temperature, top_p, top_k, seed)  # [B, 1]
        return {"token": token, "cache": cache, "count": torch.ones_like(token)}

    @walk
    def decode(self, token, cache, count, max_new_tokens, temperature, top_p, top_k, seed):
        tokens = []
        for _ in iterations(max_new_tokens):
            token, cache, count = self.step(token, cache, count, temperature, top_p, top_k, seed)
            tokens.append(token)
            if ((token == self.eos) | (count >= max_new_tokens)).all():
                break
        return {"tokens": torch.cat(tokens, dim=1)}  # [B, new tokens after the first]

    @loop
    def step(self, token, cache, count, temperature, top_p, top_k, seed):
        token, cache = self.lm(token, cache, count, temperature, top_p, top_k, seed)
        return token, cache, count + 1

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        if walk == "prefill":
            done = bool((outputs["token"] == self.eos).all()) or int(request["max_new_tokens"]) <= 1
            return None if done else "decode"
        return None


class CausalLMWalks(TextWalks, nn.Module):
    """Walks around ``lm`` (any transformers ``*ForCausalLM``) on the engine that serves it
    exactly (``hf_engine.text_engine``)."""

    def __init__(self, lm: nn.Module, eos_token_id: int, kv: PagedLMConfig | None = None) -> None:
        super().__init__()
        from walkserve.adapters.hf_engine import text_engine

        self.lm = text_engine(lm, kv)
        self.eos = eos_token_id


def sample_request(input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """A greedy request for the text walks (also the sample inputs of capture)."""
    return {
        "input_ids": torch.tensor([input_ids]),
        "max_new_tokens": max_new_tokens,
        **GREEDY_INPUTS,
    }


def load_causal_lm(path: str) -> tuple[CausalLMWalks, dict[str, Any]]:
    """A local checkpoint directory (``from_pretrained`` on a path, safetensors) as walks, with
    sample inputs for capture. The engine is chosen by ``hf_engine.text_engine``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    lm.eval()
    return CausalLMWalks(lm, eos_token_id(lm)), sample_request([1, 2, 3], 4)


def eos_token_id(lm: nn.Module) -> int:
    """The model's end-of-sequence id, as ``generate()`` reads it (its generation config, then
    its config and text config); the first of a list; 0 when it has none."""
    config: Any = lm.config
    sources = [getattr(lm, "generation_config", None), config]
    if hasattr(config, "get_text_config"):
        sources.append(config.get_text_config())
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return 0
