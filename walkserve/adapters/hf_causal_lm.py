"""Hugging Face causal LMs (Llama, Qwen2, Gemma, GPT-2, Mixtral, ...) as text walks: ``prefill``
-> ``decode``, and ``prefill_ext`` -> ``decode_ext`` for requests that ask for more (logprobs, a
logit bias, structured output).

The upstream model runs unmodified inside one ``kv_cache`` component, chosen at load time
(``hf_engine.text_engine``): ``runtime.kv.paged_lm.PagedLM`` when its attention goes through
transformers' attention-function registry in a way the paged KV pool computes exactly (the
worker that hosts it packs every ready request's prefill or decode step into one forward), else
the fallback ``runtime.kv.hf_cache_lm.HFCacheLM`` (the model's own cache per request: exact,
slower). The cache value (``PagedKV`` or ``HFCache``) travels as request state from prefill to
decode.

    prefill(input_ids, sampling...)                      -> token, cache, count
    decode(token, cache, count, max_new_tokens, sampling...) -> tokens (one per step)
    prefill_ext(input_ids, constraints, logprobs, sampling...) -> token, logprob, logprob_id, ...
    decode_ext(..., logprobs, sampling...)               -> tokens, logprobs, logprob_ids

``sampling...``: ``temperature``, ``top_p``, ``top_k``, ``seed`` (required: the walks' original
inputs), and ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``min_tokens`` with defaults that turn them off. The ``_ext`` pair adds ``constraints`` (a
``[1, L]`` uint8 tensor: ``runtime.kv.grammar.Constraints``, read when the cache is made) and
``logprobs`` (columns of the logprob outputs: the sampled token's raw log-probability, then the
most likely ids'); it is a separate pair so that the common requests' walks carry no logprob
channels (two more stream items per token) and no constraint bytes.

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

from walkserve.capture import Input, iterations, loop, register_component, walk
from walkserve.runtime.kv.grammar import HFVocabulary, Vocabulary
from walkserve.runtime.kv.hf_cache_lm import HFCacheLM
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

register_component(PagedLM, engine="kv_cache")
register_component(HFCacheLM, engine="kv_cache")

#: The sampling inputs of the text walks, with the values that mean "greedy".
GREEDY_INPUTS: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
#: The walks' sampling inputs that have defaults (off), as the API may send them.
PENALTY_INPUTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")


class TextWalks:
    """Text walks over ``self.lm`` (a ``PagedLM`` or an ``HFCacheLM``) stopping at ``self.eos``:
    mixed into a model class (``CausalLMWalks``, the built-in default model)."""

    lm: PagedLM | HFCacheLM
    eos: int

    @walk(
        next="decode",
        state=("cache", "count"),
        inputs={"input_ids": Input(vocab=lambda m: m.lm.lm.get_input_embeddings().num_embeddings)},
    )
    def prefill(
        self,
        input_ids,  # [B, T]
        temperature,
        top_p,
        top_k,
        seed,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
    ):
        token, cache = self.lm(
            input_ids, None, 0, temperature, top_p, top_k, seed, repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            min_tokens=min_tokens,
        )  # fmt: skip
        return {"token": token, "cache": cache, "count": torch.ones_like(token)}  # [B, 1]

    @walk
    def decode(
        self,
        token,
        cache,
        count,
        max_new_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
    ):
        tokens = []
        for _ in iterations(max_new_tokens):
            token, cache, count = self.step(
                token, cache, count, temperature, top_p, top_k, seed, repetition_penalty,
                presence_penalty, frequency_penalty, min_tokens,
            )  # fmt: skip
            tokens.append(token)
            if ((token == self.eos) | (count >= max_new_tokens)).all():
                break
        return {"tokens": torch.cat(tokens, dim=1)}  # [B, new tokens after the first]

    @loop
    def step(
        self, token, cache, count, temperature, top_p, top_k, seed, repetition, presence,
        frequency, min_tokens,
    ):  # fmt: skip
        token, cache = self.lm(
            token, cache, count, temperature, top_p, top_k, seed, repetition,
            presence_penalty=presence, frequency_penalty=frequency, min_tokens=min_tokens,
        )  # fmt: skip
        return token, cache, count + 1

    @walk(
        next="decode_ext",
        state=("cache", "count"),
        inputs={
            "input_ids": Input(vocab=lambda m: m.lm.lm.get_input_embeddings().num_embeddings),
            "constraints": Input(dims={1: (0, None)}),  # empty: no constraint
        },
    )
    def prefill_ext(
        self,
        input_ids,  # [B, T]
        constraints,  # [1, L] uint8
        temperature,
        top_p,
        top_k,
        seed,
        logprobs=0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
    ):
        token, cache, logprob, logprob_id = self.lm(
            input_ids, None, 0, temperature, top_p, top_k, seed, repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            min_tokens=min_tokens, constraints=constraints, logprobs=logprobs,
            with_logprobs=True,
        )  # fmt: skip
        count = torch.ones_like(token)
        # logprob, logprob_id: [B, 1, logprobs]
        return {
            "token": token, "cache": cache, "count": count, "logprob": logprob,
            "logprob_id": logprob_id,
        }  # fmt: skip

    @walk
    def decode_ext(
        self,
        token,
        cache,
        count,
        max_new_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        logprobs=0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
    ):
        tokens, values, ids = [], [], []
        for _ in iterations(max_new_tokens):
            token, cache, count, value, top = self.step_ext(
                token, cache, count, temperature, top_p, top_k, seed, logprobs,
                repetition_penalty, presence_penalty, frequency_penalty, min_tokens,
            )  # fmt: skip
            tokens.append(token)
            values.append(value)
            ids.append(top)
            if ((token == self.eos) | (count >= max_new_tokens)).all():
                break
        return {
            "tokens": torch.cat(tokens, dim=1),  # [B, n]
            "logprobs": torch.cat(values, dim=1),  # [B, n, logprobs]
            "logprob_ids": torch.cat(ids, dim=1),  # [B, n, logprobs]
        }

    @loop
    def step_ext(
        self, token, cache, count, temperature, top_p, top_k, seed, logprobs, repetition,
        presence, frequency, min_tokens,
    ):  # fmt: skip
        token, cache, value, top = self.lm(
            token, cache, count, temperature, top_p, top_k, seed, repetition,
            presence_penalty=presence, frequency_penalty=frequency, min_tokens=min_tokens,
            logprobs=logprobs, with_logprobs=True,
        )  # fmt: skip
        return token, cache, count + 1, value, top

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        if walk in ("prefill", "prefill_ext"):
            done = bool((outputs["token"] == self.eos).all()) or int(request["max_new_tokens"]) <= 1
            return None if done else walk.replace("prefill", "decode")
        return None


class CausalLMWalks(TextWalks, nn.Module):
    """Walks around ``lm`` (any transformers ``*ForCausalLM``) on the engine that serves it
    exactly (``hf_engine.text_engine``); ``vocabulary``: its tokenizer's bytes, for grammars."""

    def __init__(
        self,
        lm: nn.Module,
        eos_token_id: int,
        kv: PagedLMConfig | None = None,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        super().__init__()
        from walkserve.adapters.hf_engine import text_engine

        self.lm = text_engine(lm, kv, stop_ids=(eos_token_id,), vocabulary=vocabulary)
        self.eos = eos_token_id


def sample_request(input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """A greedy request for the text walks (also the sample inputs of capture; ``constraints``
    is read by the ``_ext`` walks only)."""
    return {
        "input_ids": torch.tensor([input_ids]),
        "max_new_tokens": max_new_tokens,
        "constraints": torch.zeros(1, 0, dtype=torch.uint8),
        **GREEDY_INPUTS,
    }


def load_causal_lm(path: str) -> tuple[CausalLMWalks, dict[str, Any]]:
    """A local checkpoint directory (``from_pretrained`` on a path, safetensors) as walks, with
    sample inputs for capture. The engine is chosen by ``hf_engine.text_engine``. In a worker
    of a tensor-parallel group (``runtime.tp.member.current_group``) only this rank's shard
    is loaded, through transformers' own TP plan (``runtime.tp.shard``)."""
    from transformers import AutoModelForCausalLM

    from walkserve.runtime.tp.member import current_group

    group = current_group()
    if group is not None:  # a rank of a tensor-parallel group: its shard only
        from walkserve.runtime.tp.shard import load_sharded

        lm = load_sharded(path, group, local_files_only=True)
    else:
        lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    lm.eval()
    eos = eos_token_id(lm)
    vocabulary = HFVocabulary(path, eos) if has_tokenizer(path) else None
    return CausalLMWalks(lm, eos, vocabulary=vocabulary), sample_request([1, 2, 3], 4)


def has_tokenizer(path: str) -> bool:
    """Whether a checkpoint directory has tokenizer files (a fast ``tokenizer.json``, or the
    vocabulary files a slow tokenizer reads)."""
    import os

    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    return any(os.path.isfile(os.path.join(path, n)) for n in names)


def text_task(
    vocab: int,
    eos: int | None,
    encode: Any,
    decode: Any,
    chat: Any,
    max_prompt_tokens: int = 2048,
    max_tokens_limit: int = 1024,
    **more: Any,
) -> Any:
    """The HTTP text task of the walks above (``prefill`` -> ``decode``, and ``prefill_ext``),
    for a tokenizer; ``more``: further ``TextTask`` fields (tools, grammars)."""
    from walkserve.api.profile import TextTask

    return TextTask(
        walk="prefill",
        prompt_input="input_ids",
        max_tokens_input="max_new_tokens",
        tokens_channel="tokens",
        first_token_output="token",
        eos_id=eos,
        vocab_size=vocab,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        default_max_tokens=16,
        encode=encode,
        decode=decode,
        chat_template=chat,
        sampling=True,
        ext_walk="prefill_ext",
        **more,
    )


def byte_text_task(vocab: int, eos: int, **limits: Any) -> Any:
    """The text task of a model over ``adapters.tokenizer.ByteTokenizer(vocab)``: the toy
    chat template, tools in the hermes format, grammars over its byte vocabulary."""
    from walkserve.adapters.tokenizer import ByteTokenizer
    from walkserve.api.profile import plain_chat, plain_tool_chat

    tok = ByteTokenizer(vocab)

    def token_bytes(token: int) -> bytes:
        return bytes([token - tok.specials]) if tok.specials <= token < tok.specials + 256 else b""

    return text_task(
        vocab,
        eos,
        tok.encode,
        tok.decode,
        plain_chat,
        **limits,
        structured_output=True,
        tool_template=plain_tool_chat,
        tool_format="hermes",
        token_bytes=token_bytes,
    )


def tiny_profile(name: str) -> Any:
    """The tiny random models (``registry.TINY_HF``): a byte tokenizer over their 256 ids."""
    from walkserve.api.profile import ModelProfile

    return ModelProfile(name, text=byte_text_task(256, 2))


def checkpoint_profile(path: str, name: str, skip_tokenizer: bool = False) -> Any:
    """A local checkpoint's own tokenizer and chat template (``AutoTokenizer``); its tools in
    the format its template teaches (``<tool_call>``: hermes; ``<|python_tag|>`` or
    ``parameters``: Llama 3's JSON). Without tokenizer files (or with ``skip_tokenizer``) the
    text task takes token-id prompts only and answers token ids (``has_tokenizer=False``)."""
    from transformers import AutoConfig

    from walkserve.api.profile import ModelProfile, plain_chat

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config()  # a VLM's vocabulary and EOS are its text model's
    eos = getattr(config, "eos_token_id", None)
    eos = text.eos_token_id if eos is None else eos
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = int(text.vocab_size)
    if skip_tokenizer or not has_tokenizer(path):
        return ModelProfile(
            name, text=text_task(vocab, eos, _no_text, _no_ids, _no_chat, has_tokenizer=False)
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    template = getattr(tok, "chat_template", None)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text))

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    def chat(messages: Any) -> str:
        if template:
            rendered = tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            return str(rendered)
        return plain_chat(messages)

    def tool_chat(messages: Any, tools: Any) -> str:
        rendered = tok.apply_chat_template(
            [_hf_message(m) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        return str(rendered)

    renders_tools = bool(template) and "tool" in str(template)
    fmt = "hermes"
    if renders_tools and "<tool_call>" not in str(template):
        fmt = (
            "llama3_json"
            if ("python_tag" in str(template) or "parameters" in str(template))
            else "hermes"
        )
    return ModelProfile(
        name,
        text=text_task(
            vocab,
            eos,
            encode,
            decode,
            chat,
            structured_output=bool(getattr(tok, "is_fast", False)),
            tool_template=tool_chat if renders_tools else None,
            tool_format=fmt,
        ),
    )


def _hf_message(message: Any) -> dict[str, Any]:
    """An OpenAI-shaped message as Hugging Face chat templates read it (tool call arguments
    as objects, as they are here already)."""
    return dict(message)


def _no_text(text: str) -> list[int]:
    raise ValueError(
        "this server has no tokenizer (--skip-tokenizer-init, or the checkpoint has no"
        " tokenizer files): send the prompt as token ids"
    )


def _no_ids(ids: list[int]) -> str:
    return ""


def _no_chat(messages: Any) -> str:
    return _no_text("")  # type: ignore[return-value]


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
