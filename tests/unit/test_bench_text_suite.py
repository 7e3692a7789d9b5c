"""The text suite's in-process parts (``benchmarks/bench_text_suite.py``): the roofline's
parameter, byte and FLOP counts against the real model and a hand count, and the bare decode
loop's tokens against HF ``generate`` on a tiny Llama."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed

from benchmarks import bench_text_suite as suite

transformers = pytest.importorskip("transformers")


def test_roofline_counts_match_the_model_and_a_hand_count() -> None:
    s = suite.SHAPE
    config = transformers.LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()  # a lookup, not a matmul
    machine = {"read_bytes_per_s": 1e9, "matmul_flops_per_s": 1e10}
    # one request: prompt 4, 3 tokens out (1 from prefill, 2 decode steps at contexts 5 and 6)
    roof = suite.roofline([([5, 6, 7, 8], 3)], machine)
    params = roof["parameters_in_matmuls"]
    assert params == total - embedding
    assert 33e6 < total < 36e6  # the issue's ~35M
    kv = (
        s.num_hidden_layers
        * 2
        * s.num_key_value_heads
        * (s.hidden_size // s.num_attention_heads)
        * 4
    )
    attn = s.num_hidden_layers * 4 * s.hidden_size  # flops per context token per new token
    steps = [max((4 * params + kv * ctx) / 1e9, (2 * params + attn * ctx) / 1e10) for ctx in (5, 6)]
    prefill = max((2 * params * 4 + attn * (1 + 2 + 3 + 4)) / 1e10, 4 * params / 1e9)
    assert roof["decode_steps"] == 2
    assert roof["decode_s"] == pytest.approx(sum(steps))
    assert roof["prefill_s"] == pytest.approx(prefill)
    assert roof["tokens_per_s"] == pytest.approx(3 / (prefill + sum(steps)))


def test_bare_loop_matches_hf_generate(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    work = [([5, 6, 7], 4), ([9, 10, 11, 12, 13, 14, 15], 9), ([20, 21], 1), ([30] * 5, 6)]
    bare = suite.run_bare(tmp_path, work)
    lm = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    for (prompt, n), got in zip(work, bare["outputs"]):
        with torch.no_grad():
            seq = lm.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0
            )
        assert got == seq[0, len(prompt) :].tolist()
    assert bare["decode_steps"] == max(n for _, n in work) - 1


def test_compare_on_fabricated_results() -> None:
    results = {
        "http": {"seconds": 10.0, "tokens_per_s": 100.0},
        "paged": {"seconds": 8.0, "tokens_per_s": 125.0},
        "paged_forward_only": {"seconds": 5.0, "tokens_per_s": 200.0},
        "bare": {"seconds": 4.0, "tokens_per_s": 250.0},
        "hf_cb": {"error": "failed"},
    }
    got = suite.compare(results, {"tokens_per_s": 1000.0})
    assert got["walkserve_http_vs"] == pytest.approx(
        {"paged": 0.8, "paged_forward_only": 0.5, "bare": 0.4}
    )
    assert got["paged_vs"]["http"] == pytest.approx(1.25)
    # overhead = time / baseline time - 1: http 10 s vs bare 4 s -> 1.5
    assert got["time_overhead_vs_bare"]["http"] == pytest.approx(1.5)
    assert got["time_overhead_vs_bare"]["bare"] == 0.0
    assert got["time_overhead_vs_paged_forward"] == pytest.approx({"http": 1.0, "paged": 0.6})
    assert got["fraction_of_roofline"]["bare"] == pytest.approx(0.25)
    assert "hf_cb" not in got["fraction_of_roofline"]
    assert suite.compare({"bare": {"tokens_per_s": 1.0}}, {"error": "x"}) == {
        "time_overhead_vs_bare": {"bare": 0.0}
    }
