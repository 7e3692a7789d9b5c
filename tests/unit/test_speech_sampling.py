"""Per-request sampling in the speech adapters (Orpheus, Qwen2.5-Omni, Qwen3-Omni): the
``TokenSampler`` component on its own (its draw is ``paged_lm.seeded_token``: greedy at
temperature 0, seeded by ``(seed, row, step)``, rows independent of their batch), and the
captured walks through the reference interpreter: temperature 0 and top_k 1 equal the greedy
walk (itself equal to upstream ``generate()``, see the adapters' own tests), a fixed seed gives
the same tokens on every run, a high temperature leaves greedy, and one step's draws over many
seeds follow ``softmax(logits / T)`` of the upstream model's own logits, cut to the top k."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import orpheus
from walkserve.adapters import qwen3_omni as q3
from walkserve.adapters import qwen25_omni as q25
from walkserve.adapters.speech_sampling import STREAMS, TokenSampler
from walkserve.lowering.lower import lower
from walkserve.lowering.plan import LoopPlan, NodePlan
from walkserve.runtime.kv.paged_lm import seeded_token
from walkserve.runtime.kv.sampling import top_k_filter, top_p_filter

pytest.importorskip("transformers")


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert float(counts[~keep].sum()) == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ----------------------------------------------------------------------------- the sampler


def test_temperature_zero_is_the_argmax_op_and_top_k_one_is_greedy() -> None:
    logits = torch.randn(3, 1, 50, generator=torch.Generator().manual_seed(0))
    sampler = TokenSampler()
    step = torch.tensor([[0], [4], [9]])
    assert torch.equal(sampler(logits, step), logits.argmax(-1))
    assert torch.equal(sampler(logits, step, 1.5, 1.0, 1, 7), logits.argmax(-1))


def test_a_row_draws_by_its_request_seed_row_and_step_only() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1, 1, 40, generator=g), torch.randn(2, 1, 40, generator=g)
    sampler = TokenSampler(stream=1)
    first = sampler(a, torch.tensor([[3]]), 2.0, 0.95, 20, 11)
    sampler(b, torch.tensor([[0], [5]]), 2.0, 1.0, 0, 11)  # another request's draw between
    assert torch.equal(sampler(a, torch.tensor([[3]]), 2.0, 0.95, 20, 11), first)
    # Row r of a request draws from the generator of (seed, r, step * STREAMS + stream).
    pair = sampler(torch.cat([b[:1], a]), torch.tensor([[0], [3]]), 2.0, 0.95, 20, 11)
    want = seeded_token(a[0, 0], 1, 3 * STREAMS + 1, 2.0, 0.95, 20, 11)
    assert int(pair[1, 0]) == want


def test_the_samplers_are_glue_that_runs_with_the_forward_before_them(q3_tiny: Any) -> None:
    """No sampler is a dispatch of its own: a thinker decode step is one node."""
    _, _, captured = q3_tiny
    plan = lower(captured, q3.tiny()[1], check_capture=False)
    walk = plan.walks["chat"].nodes
    assert [n.name for n in walk if isinstance(n, NodePlan)] == ["thinker_lm"]
    step = next(n for n in walk if isinstance(n, LoopPlan))
    assert [n.name for n in step.body.nodes] == ["think_step/thinker_lm"]
    first = step.body.nodes[0]
    assert isinstance(first, NodePlan)
    assert any("sample_tokens" in op for op in first.ops)


def test_samplers_of_one_request_draw_independent_streams() -> None:
    logits = torch.zeros(1, 1, 1000)  # uniform: any shared stream would repeat tokens
    draws = [TokenSampler(stream=s)(logits, 5, 1.0, 1.0, 0, 3) for s in range(STREAMS)]
    assert len({int(t) for t in draws}) == STREAMS
    with pytest.raises(ValueError, match="stream"):
        TokenSampler(stream=STREAMS)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8)]
)
def test_draws_over_seeds_follow_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float
) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    sampler = TokenSampler(stream=2)
    counts = torch.zeros(8)
    for seed in range(3000):
        counts[int(sampler(logits.view(1, 1, -1), 0, temperature, top_p, top_k, seed))] += 1
    probs = torch.softmax(top_p_filter(top_k_filter(logits / temperature, top_k), top_p), -1)
    dof = int((probs > 0).sum()) - 1
    assert chi2(counts, probs) < {7: 24.3, 3: 16.3, 2: 13.8, 1: 10.8}.get(dof, 24.3), counts


# ----------------------------------------------------------------------------- Orpheus


@pytest.fixture(scope="module")
def orpheus_tiny() -> tuple[orpheus.OrpheusTTS, dict[str, Any], capture.CapturedModel]:
    model, sample = orpheus.tiny()
    return model, sample, capture.trace(model, sample)


def test_orpheus_sampling(orpheus_tiny: Any) -> None:
    _, sample, captured = orpheus_tiny
    r = {"input_ids": sample["input_ids"], "max_new_tokens": 30}
    greedy = captured.run(r, walk="speak")["tokens"]
    explicit = captured.run({**r, "temperature": 0.0, "top_k": 5, "seed": 9}, walk="speak")
    assert torch.equal(explicit["tokens"], greedy)
    top1 = captured.run({**r, "temperature": 1.0, "top_k": 1, "seed": 9}, walk="speak")
    assert torch.equal(top1["tokens"], greedy)
    hot = {**r, "temperature": 3.0, "top_p": 0.95, "seed": 5}
    first, second = captured.run(hot, walk="speak"), captured.run(hot, walk="speak")
    assert torch.equal(first["tokens"], second["tokens"])
    assert torch.equal(first["waveform"], second["waveform"])
    assert not torch.equal(first["tokens"], greedy)
    other = captured.run({**hot, "seed": 6}, walk="speak")
    assert not torch.equal(other["tokens"], first["tokens"])


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_orpheus_greedy_with_repetition_penalty_equals_generate(
    orpheus_tiny: Any, penalty: float
) -> None:
    model, sample, captured = orpheus_tiny
    ids = sample["input_ids"]
    want = orpheus.reference_lm(model).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=35,
        repetition_penalty=penalty,
        eos_token_id=model.eos,
        pad_token_id=model.eos,
    )[:, ids.shape[1] :]
    r = {"input_ids": ids, "max_new_tokens": 35, "repetition_penalty": penalty}
    got = captured.run(r, walk="speak")["tokens"]
    assert torch.equal(got, want)
    assert not torch.equal(
        got, captured.run({**r, "repetition_penalty": 1.0}, walk="speak")["tokens"]
    )


def test_orpheus_first_step_follows_the_upstream_softmax(orpheus_tiny: Any) -> None:
    """One step (max_new_tokens=1) per seed: the drawn token's frequencies against
    ``softmax(top_k(logits / T))`` of the upstream LM's own logits for that step."""
    model, sample, captured = orpheus_tiny
    ids = sample["input_ids"]
    with torch.no_grad():
        logits = orpheus.reference_lm(model)(input_ids=ids).logits[0, -1]  # [V]: after the prompt
    temperature, top_k = 2.0, 6
    probs = torch.softmax(top_k_filter(logits / temperature, top_k), -1)
    counts = torch.zeros_like(probs)
    for seed in range(200):
        r = {"input_ids": ids, "max_new_tokens": 1, "temperature": temperature}
        out = captured.run({**r, "top_k": top_k, "seed": seed}, walk="speak")
        counts[int(out["tokens"][0, 0])] += 1
    assert chi2(counts, probs) < 20.5, counts[probs > 0]  # 5 degrees of freedom, p = 0.001


# ----------------------------------------------------------------------------- Qwen2.5-Omni


@pytest.fixture(scope="module")
def q25_tiny() -> tuple[q25.Qwen25OmniWalks, dict[str, Any], capture.CapturedModel]:
    walks, sample = q25.tiny()
    return walks, sample, capture.trace(walks, sample)


def test_qwen25_sampling(q25_tiny: Any) -> None:
    _, sample, captured = q25_tiny
    greedy = captured.run(sample, walk="speak")
    zero = {"temperature": 0.0, "talker_temperature": 0.0, "top_k": 3, "seed": 4}
    zero_out = captured.run({**sample, **zero}, walk="speak")
    assert_same(zero_out, greedy, but=("waveform",))  # the seed is token2wav's noise too
    assert not torch.equal(zero_out["waveform"], greedy["waveform"])
    top1 = {"temperature": 1.0, "top_k": 1, "talker_temperature": 1.0, "talker_top_k": 1}
    top1_out = captured.run({**sample, **top1}, walk="speak")
    assert_same(top1_out, greedy)
    hot = {**sample, "temperature": 3.0, "talker_temperature": 3.0, "seed": 7}
    first, second = captured.run(hot, walk="speak"), captured.run(hot, walk="speak")
    assert_same(first, second)
    assert not torch.equal(first["text_tokens"], greedy["text_tokens"])
    # The talker alone sampling: the thinker's text stays greedy, the codes leave it.
    talker_only = captured.run({**sample, "talker_temperature": 3.0, "seed": 7}, walk="speak")
    assert torch.equal(talker_only["text_tokens"], greedy["text_tokens"])
    assert not torch.equal(talker_only["codes"], greedy["codes"])


def test_qwen25_greedy_talker_with_repetition_penalty_equals_generate(q25_tiny: Any) -> None:
    walks, sample, captured = q25_tiny
    model = walks.upstream
    seen: dict[str, torch.Tensor] = {}
    talker_generate = model.talker.generate

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen["codes"] = out = talker_generate(*args, **kwargs)
        return out

    model.talker.generate = spy
    try:
        torch.manual_seed(0)
        _, waveform = model.generate(
            sample["input_ids"],
            speaker="Chelsie",
            thinker_max_new_tokens=sample["max_new_tokens"],
            thinker_eos_token_id=walks.eos,
            thinker_do_sample=False,
            talker_max_new_tokens=sample["max_audio_tokens"],
            talker_do_sample=False,
            talker_repetition_penalty=1.5,
            talker_eos_token_id=list(walks.codec_eos),
        )
    finally:
        del model.talker.generate
    want = seen["codes"][:, sample["input_ids"].shape[1] + 2 :]
    got = captured.run({**sample, "talker_repetition_penalty": 1.5}, walk="speak")
    assert torch.equal(torch.cat([got["first_code"], got["codes"]], dim=1), want)
    assert torch.equal(got["waveform"][0, 0], waveform)
    plain = captured.run(sample, walk="speak")
    assert not torch.equal(plain["codes"], got["codes"])


def assert_same(got: dict[str, Any], want: dict[str, Any], but: tuple[str, ...] = ()) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key not in but:
            assert torch.equal(got[key], value), key


# ----------------------------------------------------------------------------- Qwen3-Omni


@pytest.fixture(scope="module")
def q3_tiny() -> tuple[q3.Qwen3OmniWalks, dict[str, Any], capture.CapturedModel]:
    """The walks, a text-only speech request (the factory's sample also holds media inputs,
    for the media walks' capture) and the captured model."""
    walks, sample = q3.tiny()
    text = {
        "input_ids": q3.chat_prompt(walks.upstream.config, [10, 11, 12, 13, 14]),
        "max_new_tokens": 16,
        "max_audio_tokens": 40,
        "speaker_id": q3.TINY_SPEAKER,
    }
    return walks, text, capture.trace(walks, sample)


def test_qwen3_greedy_talker_with_repetition_penalty_equals_generate(q3_tiny: Any) -> None:
    walks, sample, captured = q3_tiny
    _, codes, _ = q3.upstream_speech(walks, sample, talker_repetition_penalty=1.5)
    got = captured.run({**sample, "talker_repetition_penalty": 1.5}, walk="speak")
    assert torch.equal(got["codes"], codes)
    assert not torch.equal(got["codes"], captured.run(sample, walk="speak")["codes"])


def test_qwen3_sampling(q3_tiny: Any) -> None:
    _, sample, captured = q3_tiny
    greedy = captured.run(sample, walk="speak")
    top1 = {
        **{"temperature": 1.0, "top_k": 1, "talker_temperature": 1.0, "talker_top_k": 1},
        **{"predictor_temperature": 1.0, "predictor_top_k": 1, "seed": 3},
    }
    assert_same(captured.run({**sample, **top1}, walk="speak"), greedy)
    hot = {**sample, "temperature": 3.0, "talker_temperature": 3.0, "seed": 7}
    hot["predictor_temperature"] = 3.0
    first, second = captured.run(hot, walk="speak"), captured.run(hot, walk="speak")
    assert_same(first, second)
    assert not torch.equal(first["text_tokens"], greedy["text_tokens"])
    # Only the code predictor sampling: text and the first code group stay greedy until the
    # residuals feed back; the residual groups leave greedy at once.
    residual = captured.run({**sample, "predictor_temperature": 3.0, "seed": 7}, walk="speak")
    assert torch.equal(residual["text_tokens"], greedy["text_tokens"])
    assert torch.equal(residual["codes"][:, 0, :1], greedy["codes"][:, 0, :1])
    assert not torch.equal(residual["codes"][:, 1:, :1], greedy["codes"][:, 1:, :1])
    chat = {"input_ids": sample["input_ids"], "max_new_tokens": 8}
    chat_greedy = captured.run(chat, walk="chat")
    assert torch.equal(chat_greedy["text_tokens"], greedy["text_tokens"][:, :7])
    chat_hot = captured.run({**chat, "temperature": 3.0, "seed": 7}, walk="chat")
    assert torch.equal(chat_hot["text_tokens"], first["text_tokens"][:, :7])
