"""The bridge to transformers' attention interface: every argument a layer passes is honoured or
refused, masks are classified (plain causal, sliding window) or refused, probes record each
layer's shape and scores; models built with a non-default scale or a soft cap are exact (and
would not be if either were ignored, as they were before), the start-up self-check catches an
attention that drops one, and a sliding-window model's memory stays bounded while it serves."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import (  # noqa: E402
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)

from walkserve.adapters import hf_zoo  # noqa: E402
from walkserve.adapters.hf_engine import SelfCheckFailed, self_check, text_engine  # noqa: E402
from walkserve.runtime.kv import hf  # noqa: E402
from walkserve.runtime.kv.hf_attention import (  # noqa: E402
    PagedMask,
    Probe,
    UnsupportedAttention,
    attention_context,
    paged_attention_forward,
    paged_mask,
    probe_attention,
)
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig  # noqa: E402
from walkserve.testing import greedy_generate, serve_text_greedy  # noqa: E402


def generate(lm: nn.Module, prompt: list[int], n: int) -> list[int]:
    return greedy_generate(lm, prompt, n, hf_zoo.EOS)


def serve_greedy(
    engine: PagedLM, work: list[tuple[list[int], int]]
) -> tuple[list[list[int]], list[int]]:
    return serve_text_greedy(engine, work, hf_zoo.EOS)


def workload(count: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts of 1..40 tokens, 1..24 new tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(
                3, hf_zoo.VOCAB, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g
            ).tolist(),
            int(torch.randint(1, 25, (1,), generator=g)),
        )
        for _ in range(count)
    ]


class Layer(nn.Module):
    def __init__(self, layer_idx: int = 0, is_causal: bool = True) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = is_causal


def call(module: nn.Module | None = None, mask: object = PagedMask(None), **kwargs: object) -> None:
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with attention_context(Probe()):
        paged_attention_forward(module or Layer(), q, kv, kv, mask, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"position_bias": torch.zeros(1, 4, 3, 3)}, "position_bias"),
        ({"cu_seq_lens_q": torch.tensor([0, 3])}, "cu_seq_lens_q"),
        ({"output_attentions": True}, "output_attentions"),
        ({"dropout": 0.1}, "dropout"),
        ({"is_causal": False}, "not causal"),
        ({"sliding_window": 4}, "sliding_window=4 but its mask has window None"),
        ({"softcap": -1.0}, "softcap"),
        ({"s_aux": torch.zeros(3)}, "sinks of shape"),
    ],
)
def test_what_paged_attention_cannot_honour_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(UnsupportedAttention, match=message):
        call(**kwargs)


def test_harmless_arguments_pass() -> None:
    call(position_ids=torch.arange(3), use_cache=False, output_attentions=False, indices=None)
    call(mask=PagedMask(4), sliding_window=4, softcap=2.0, s_aux=torch.zeros(4), scaling=0.1)


def test_a_model_that_makes_its_own_masks_or_is_not_causal_is_refused() -> None:
    with pytest.raises(UnsupportedAttention, match="not one built by transformers' mask"):
        call(mask=torch.zeros(1, 1, 3, 3))
    with pytest.raises(UnsupportedAttention, match="not causal"):
        call(module=Layer(is_causal=False))
    with pytest.raises(UnsupportedAttention, match="no integer layer_idx"):
        call(module=nn.Module())


def mask(fn: object, **kwargs: object) -> PagedMask:
    return paged_mask(1, 3, 3, mask_function=fn, **kwargs)  # type: ignore[arg-type]


def test_masks_are_classified_from_transformers_own_mask_functions() -> None:
    assert mask(causal_mask_function) == PagedMask(None)
    assert mask(sliding_window_causal_mask_function(5), local_size=5) == PagedMask(5)
    assert mask(sliding_window_causal_mask_function(2**20), local_size=2**20) == PagedMask(2**20)
    with pytest.raises(UnsupportedAttention, match="overlay"):
        mask(causal_mask_function, allow_is_causal_skip=False)
    with pytest.raises(UnsupportedAttention, match="not a causal window"):
        mask(bidirectional_mask_function)
    with pytest.raises(UnsupportedAttention, match="chunked"):
        mask(chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)))
    with pytest.raises(UnsupportedAttention, match="does not match its window 3"):
        mask(sliding_window_causal_mask_function(5), local_size=3)
    with pytest.raises(UnsupportedAttention, match="padded"):
        mask(causal_mask_function, attention_mask=torch.tensor([[0, 1, 1]], dtype=torch.bool))


def test_probe_records_each_layer() -> None:
    gemma2 = hf_zoo.build("gemma2")
    gemma2.set_attn_implementation(hf.register())
    layers = probe_attention(gemma2).layers
    assert [(a.window, a.softcap, a.scale) for a in layers] == [
        (8, 1.5, 24**-0.5),
        (None, 1.5, 24**-0.5),
    ]
    deepseek = hf_zoo.build("deepseek-v3")
    deepseek.set_attn_implementation(hf.register())
    assert {(a.head_dim, a.v_head_dim) for a in probe_attention(deepseek).layers} == {(12, 6)}
    oss = hf_zoo.build("gpt-oss")
    oss.set_attn_implementation(hf.register())
    assert all(a.sinks for a in probe_attention(oss).layers)


def test_a_non_causal_config_is_refused_on_the_pool() -> None:
    lm = hf_zoo.build("llama")
    lm.config.is_causal = False  # transformers then builds a bidirectional mask
    engine = text_engine(lm)
    assert engine.engine_choice.engine == "hf-cache"
    assert "not plain causal" in (engine.engine_choice.reason or "")


# --- non-default scores, exact, and wrong when dropped ---------------------------------------


def drop(what: str):  # type: ignore[no-untyped-def]
    """A ``PagedStep.attend`` that forgets the layer's soft cap or scale: the bug this module's
    tests exist to catch (the paged path ignored both before)."""
    attend = hf.PagedStep.attend

    def broken(self, layer, q, k, v, window, scores):  # type: ignore[no-untyped-def]
        if what == "softcap":
            scores = replace(scores, softcap=None)
        else:
            scores = replace(scores, scale=q.shape[-1] ** -0.5)
        return attend(self, layer, q, k, v, window, scores)

    return broken


@pytest.mark.parametrize(("name", "what"), [("gemma2", "softcap"), ("granite", "scale")])
def test_soft_cap_and_scale_are_exact_and_wrong_if_ignored(
    name: str, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = hf_zoo.build(name, attn_implementation="eager")
    work = workload(8, seed=3)
    want = [generate(reference, p, n) for p, n in work]
    kv = PagedLMConfig(pool_tokens=2048, page_size=4)
    engine = text_engine(copy.deepcopy(reference), kv)
    assert isinstance(engine, PagedLM)
    assert serve_greedy(engine, work)[0] == want
    monkeypatch.setattr(hf.PagedStep, "attend", drop(what))
    assert serve_greedy(PagedLM(copy.deepcopy(reference), kv), work)[0] != want
    with pytest.raises(SelfCheckFailed, match=r"first at layer 0 \(hidden states differ"):
        self_check(engine)


# --- sliding windows while serving -----------------------------------------------------------


@pytest.mark.parametrize("name", ["mistral", "qwen2-sliding"])
def test_served_sliding_layers_hold_at_most_window_over_page_plus_one_pages(name: str) -> None:
    """One request running for 10 windows: after every step its sliding groups hold at most
    window / page + 1 pages (window 8, page 4: 3); full groups hold every page. The tokens are
    still generate()'s."""
    reference = hf_zoo.build(name, attn_implementation="eager")
    engine = PagedLM(copy.deepcopy(reference), PagedLMConfig(pool_tokens=512, page_size=4))
    prompt, steps = [5, 9, 44, 71, 3], 10 * hf_zoo.WINDOW
    token, cache = engine(torch.tensor([prompt]))
    out = [int(token)]
    pool = engine._state.pool  # type: ignore[union-attr]
    held: list[list[int]] = []
    for step in range(1, steps):
        token, cache = engine(token, cache, step)
        out.append(int(token))
        held.append([len(t.pages) for t in pool.block_tables(cache.seqs[0])])
    assert out == generate(reference, prompt, steps)
    windows = [g.window for g in pool.groups]
    assert 8 in windows
    for counts in held:
        for window, n in zip(windows, counts):
            if window is not None:
                assert n <= window // 4 + 1
    for window, n in zip(windows, held[-1]):
        if window is None:
            assert n == pool.pages_for(len(prompt) + steps - 1)
    del cache
    assert engine.kv_stats().pages_in_use == 0  # type: ignore[union-attr]
