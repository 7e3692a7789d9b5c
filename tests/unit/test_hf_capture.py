"""Capturing unmodified Hugging Face causal LMs: prefill and decode walks, token-exact
against ``generate(do_sample=False)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve import capture  # noqa: E402
from walkserve.adapters.hf_causal_lm import (  # noqa: E402
    CausalLMWalks,
    load_causal_lm,
    sample_request,
)
from walkserve.capture import ir  # noqa: E402

EOS = 5


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=256,
        initializer_range=0.15,  # varied greedy output from random weights
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
    )
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common)).eval()


def generated(captured: capture.CapturedModel, ids: torch.Tensor, n: int) -> list[int]:
    out = captured.run({**sample_request([], n), "input_ids": ids})
    tokens = [out["token"]] + ([out["tokens"]] if "tokens" in out else [])
    return torch.cat(tokens, dim=1)[0].tolist()


def reference(lm: torch.nn.Module, ids: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        seq = lm.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    return seq[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_decode_walks_match_generate(arch: str) -> None:
    lm = tiny(arch)  # upstream, with transformers' own attention
    captured = capture.trace(CausalLMWalks(tiny(arch), EOS), sample_request([1, 7, 9], 4))
    assert list(captured.walks) == ["prefill", "decode", "prefill_ext", "decode_ext"]
    decode = captured.walk("decode")
    (loop,) = decode.body.nodes
    assert isinstance(loop, ir.LoopNode) and loop.dynamic
    assert loop.max_iters == "max_new_tokens"
    assert captured.graph.components["lm"].engine == "kv_cache"
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        length = int(torch.randint(1, 24, (1,), generator=g))
        ids = torch.randint(6, 128, (1, length), generator=g)
        n = int(torch.randint(1, 16, (1,), generator=g))
        assert generated(captured, ids, n) == reference(lm, ids, n)


def test_eos_stops_in_prefill_and_in_decode() -> None:
    lm = tiny("llama")
    ids = torch.tensor([[3, 17, 42, 8]])
    free = reference(lm, ids, 10)
    served = tiny("llama")
    # Make the 1st and then the 4th greedy token the EOS: generation must stop right there.
    for stop_at in (0, 3):
        eos = free[stop_at]
        lm.generation_config.eos_token_id = eos
        captured = capture.trace(CausalLMWalks(served, eos), sample_request([3, 17, 42, 8], 4))
        expected = reference(lm, ids, 10)
        assert expected == free[: stop_at + 1]
        assert generated(captured, ids, 10) == expected


def test_local_checkpoint_directory(tmp_path: Path) -> None:
    lm = tiny("qwen2")
    lm.save_pretrained(tmp_path)
    model, sample = load_causal_lm(str(tmp_path))
    captured = capture.trace(model, sample)
    ids = torch.tensor([[9, 10, 11, 12, 13]])
    assert generated(captured, ids, 8) == reference(lm, ids, 8)
