"""Per-request sampling: the pure function on fabricated logits (checked against plain references
and transformers' own logits processor), then seeded sampling through ``PagedLMEngine``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.kv.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    sample,
    sample_row,
    top_p_filter,
)

# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop_token_ids": [1, 2]}, "tuple"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_bad_params_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


# --- the pure function ------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=gen(0))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(6)]
    got = sample(logits, params, [gen(i) for i in range(6)], [[] for _ in range(6)])
    assert got == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=gen(1))
    params = [SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(8)]
    got = sample(logits, params, [gen(i) for i in range(8)], [[] for _ in range(8)])
    assert got == logits.argmax(-1).tolist()


def test_a_row_does_not_depend_on_its_batch() -> None:
    logits = torch.randn(8, 64, generator=gen(2))
    params = [
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(),
        SamplingParams(temperature=1.5, top_k=5, seed=3),
        SamplingParams(temperature=0.7, top_p=0.8, seed=4),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, seed=5),
        SamplingParams(temperature=2.0, seed=6),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=10, seed=7),
    ]
    seen = [[1, 2, 3]] * 8
    batch = [gen(p.seed or 0) for p in params]
    together = [sample(logits, params, batch, seen) for _ in range(5)]  # 5 steps
    for i, p in enumerate(params):
        g = gen(p.seed or 0)
        alone = [sample(logits[i : i + 1], [p], [g], [seen[i]])[0] for _ in range(5)]
        assert alone == [step[i] for step in together], f"row {i}"


def reference_top_p(probs: list[float], p: float) -> set[int]:
    """Most likely first; take tokens until the mass taken is >= p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept: set[int] = set()
    mass = 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=40).map(
        lambda xs: torch.tensor(xs)
    ),
    p=st.floats(0.01, 1.0, exclude_min=False),
)
def test_top_p_keeps_the_smallest_set_with_enough_mass(logits: torch.Tensor, p: float) -> None:
    probs = torch.softmax(logits.double(), -1).tolist()
    kept = set(torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist())
    want = reference_top_p(probs, p)
    assert len(kept) == len(want)  # the same size; ties may pick different equal tokens
    assert sorted(probs[i] for i in kept) == sorted(probs[i] for i in want)
    assert sum(probs[i] for i in kept) >= min(p, 1.0) - 1e-9


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    vocab=st.integers(2, 60),
    penalty=st.floats(0.1, 5.0),
    seen_len=st.integers(0, 30),
)
def test_repetition_penalty_matches_transformers(
    seed: int, vocab: int, penalty: float, seen_len: int
) -> None:
    transformers = pytest.importorskip("transformers")
    g = gen(seed)
    logits = torch.randn(vocab, generator=g) * 3  # positive and negative logits
    seen = torch.randint(0, vocab, (seen_len,), generator=g)  # with repeats
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=penalty)
    want = processor(seen.unsqueeze(0), logits.unsqueeze(0).clone())[0]
    got = apply_repetition_penalty(logits, seen.tolist(), penalty)
    torch.testing.assert_close(got, want)


def test_greedy_with_penalty_takes_the_penalized_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    assert sample(logits, params, [None], [[1]]) == [2]  # 3 / 2 = 1.5 < 2


def test_frequencies_follow_softmax_over_temperature() -> None:
    """Chi-square goodness of fit; seeded, so the test is deterministic."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.7
    params = SamplingParams(temperature=temperature, seed=0)
    g = gen(0)
    draws = 6000
    counts = torch.zeros(6)
    for _ in range(draws):
        counts[sample_row(logits, params, g, [])] += 1
    expected = torch.softmax(logits / temperature, -1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001


def test_top_k_never_draws_outside_the_k_best() -> None:
    logits = torch.randn(40, generator=gen(3))
    best = set(torch.topk(logits, 4).indices.tolist())
    params = SamplingParams(temperature=3.0, top_k=4)
    g = gen(1)
    assert {sample_row(logits, params, g, []) for _ in range(300)} <= best


# --- through the engine -----------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

from walkserve.runtime.kv import hf  # noqa: E402
from walkserve.runtime.kv.engine import PagedLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    path: Path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(
        path, attn_implementation=hf.register()
    ).eval()


def engine_for(model: torch.nn.Module, pool_pages: int = 128) -> PagedLMEngine:
    return PagedLMEngine(model, pool_pages=pool_pages, page_size=8, max_batch_tokens=256)


def prompt(i: int) -> list[int]:
    return torch.randint(2, 128, (5 + 9 * i,), generator=gen(100 + i)).tolist()


def run_one(model: torch.nn.Module, params: SamplingParams, n: int = 24) -> list[int]:
    engine = engine_for(model)
    engine.add_request("x", prompt(0), n, sampling=params)
    return engine.run()["x"]


MIXED = [
    SamplingParams(),
    SamplingParams(temperature=1.5, top_k=5, seed=3),
    SamplingParams(temperature=0.7, top_p=0.8, seed=4),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=5),
    SamplingParams(temperature=2.0, seed=None),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=10, seed=7),
]


@pytest.mark.parametrize(
    "pool_pages", [128, pytest.param(14, marks=pytest.mark.slow)]
)  # 14 pages: preemption and recompute
def test_a_seeded_request_is_the_same_alone_and_in_a_mixed_batch(
    paged: torch.nn.Module, pool_pages: int
) -> None:
    params = SamplingParams(temperature=1.2, top_p=0.95, seed=1234)
    alone = run_one(paged, params)
    engine = engine_for(paged, pool_pages)
    engine.add_request("x", prompt(0), 24, sampling=params)
    for i, other in enumerate(MIXED):
        engine.add_request(f"o{i}", prompt(i + 1), 10 + 3 * i, sampling=other)
    outputs = engine.run()
    assert outputs["x"] == alone
    assert alone != run_one(paged, SamplingParams(temperature=1.2, top_p=0.95, seed=4321))
    assert engine.stats().pages_in_use == 0
    if pool_pages == 14:
        assert engine.stats().preemptions > 0


def test_temperature_zero_and_top_k_one_are_greedy(paged: torch.nn.Module) -> None:
    greedy = run_one(paged, SamplingParams())
    assert run_one(paged, SamplingParams(temperature=0.0, top_p=0.3, seed=9)) == greedy
    assert run_one(paged, SamplingParams(temperature=1.7, top_k=1, seed=9)) == greedy


def test_stop_token_ends_the_request(paged: torch.nn.Module) -> None:
    greedy = run_one(paged, SamplingParams())
    stop = greedy[5]
    cut = greedy.index(stop) + 1
    assert run_one(paged, SamplingParams(stop_token_ids=(stop,))) == greedy[:cut]
