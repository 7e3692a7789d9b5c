"""Cost of the structured-output mask in a decode step: ``python benchmarks/bench_grammar.py``.

The bench model of ``bench_text.py`` (a ~35M-parameter random Llama, vocab 8192, fp32) runs
inside ``PagedLM``. Its vocabulary for the grammar engine is a byte-level BPE of 8192 tokens
trained here on walkserve's own source (``tokenizers``), so the mask is computed over
multi-byte tokens as a real tokenizer's would be. For each batch size, ``--steps`` decode
steps (one ``forward_batch`` of every row) are timed with the rows sampling at temperature 1
(seeded), once with no grammar and once with every row under a JSON-schema grammar (an array
of strings that never closes within the run, so every step is masked), alternating the two
step by step so that machine noise hits both alike. Reports the median step time of each and
the overhead ``(grammar - plain) / plain``; the target is <= 10%. Writes
``benchmarks/results/grammar.json`` with the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 8192
SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 10000}


class BPEVocabulary:
    """A ``tokenizers`` BPE as the grammar engine's tokenizer (``grammar.Vocabulary``)."""

    def __init__(self, tokenizer_json: str) -> None:
        self.json = tokenizer_json

    def tokenizer(self, n_vocab: int) -> Any:
        import llguidance

        return llguidance.LLTokenizer(self.json, n_vocab=n_vocab, eos_token=2)


def train_bpe() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    files = sorted(str(p) for p in (ROOT / "walkserve").rglob("*.py"))
    tok.train(files, trainer)
    return str(tok.to_str())


def build_lm(vocabulary: BPEVocabulary) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    lm = LlamaForCausalLM(config).eval()
    return PagedLM(lm, PagedLMConfig(pool_tokens=1 << 16), stop_ids=(2,), vocabulary=vocabulary)


def measure(lm: Any, batch: int, steps: int, prompt: int) -> dict[str, float]:
    import llguidance

    from walkserve.runtime.kv import grammar

    schema = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    masked = grammar.encode(grammar.Constraints(grammar=schema))
    plain = grammar.encode(grammar.Constraints())
    g = torch.Generator().manual_seed(0)
    runs: dict[str, list[Any]] = {}
    for name, constraints in (("plain", plain), ("grammar", masked)):
        rows = []
        for r in range(batch):
            ids = torch.randint(3, VOCAB, (1, prompt), generator=g)
            kwargs = {"constraints": constraints}
            token, cache = lm(ids, None, 0, 1.0, 1.0, 0, r, **kwargs)
            rows.append([token, cache, torch.ones_like(token)])
        runs[name] = rows
    times: dict[str, list[float]] = {"plain": [], "grammar": []}
    for _ in range(steps):
        for name in ("plain", "grammar"):
            rows = runs[name]
            calls = [((t, c, n, 1.0, 1.0, 0, r), {}) for r, (t, c, n) in enumerate(rows)]
            start = time.perf_counter()
            out = lm.forward_batch(calls)
            times[name].append(time.perf_counter() - start)
            for row, (token, cache) in zip(rows, out, strict=True):
                row[0], row[1], row[2] = token, cache, row[2] + 1
    guides = [row.guide for row in lm._state.rows.values() if row.guide is not None]
    live = [g for g in guides if not g.matcher.is_error() and not g.matcher.is_stopped()]
    assert len(live) >= batch, f"{len(live)} of {batch} rows are still under their grammar"
    p, q = statistics.median(times["plain"]), statistics.median(times["grammar"])
    logits = torch.randn(VOCAB)
    start = time.perf_counter()
    for _ in range(100):  # one row's mask alone: computed, unpacked, applied
        logits.masked_fill(~live[0].allowed(), float("-inf"))
    mask_us = 1e6 * (time.perf_counter() - start) / 100
    return {
        "batch": batch,
        "plain_ms": 1e3 * p,
        "grammar_ms": 1e3 * q,
        "overhead": (q - p) / p,
        "mask_us_per_row": mask_us,
    }


def main() -> int:
    from walkserve.benchmarking import write_result

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/grammar.json"))
    args = parser.parse_args()
    before = list(os.getloadavg())
    t0 = time.perf_counter()
    vocabulary = BPEVocabulary(train_bpe())
    print(f"trained a {VOCAB}-token BPE in {time.perf_counter() - t0:.1f} s", flush=True)
    lm = build_lm(vocabulary)
    lm(torch.tensor([[5, 6, 7]]), None, 0)  # first-call costs stay out of the timing
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        r = measure(lm, batch, args.steps, args.prompt)
        results.append(r)
        print(
            f"batch {batch:3d}: plain {r['plain_ms']:.2f} ms/step, grammar"
            f" {r['grammar_ms']:.2f} ms/step, overhead {100 * r['overhead']:+.1f}%"
            f" (one row's mask alone: {r['mask_us_per_row']:.0f} us)",
            flush=True,
        )
    write_result(
        Path(args.out), {"benchmark": "grammar", "vocab": VOCAB, "results": results}, before
    )
    print(f"load average before {before}, after {list(os.getloadavg())}")
    return 0 if all(r["overhead"] <= 0.10 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
