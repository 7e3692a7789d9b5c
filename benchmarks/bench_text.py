"""Text generation throughput: ``python benchmarks/bench_text.py [--quick]``.

A ~35M-parameter random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8192, fp32),
``--requests`` (32) requests with prompt and output lengths uniform in ``[--min-len,
--max-len]`` ([16, 256], seeded), greedy, no EOS (every request makes exactly its output
length). Three ways, each in a fresh process (repeated ``generate`` calls in one process slow
down on small VMs):

    paged       PagedLMEngine: continuous batching over the paged KV pool, all requests
                submitted at once, prefill and decode mixed in one packed forward per step
    static8     HF generate, static batches of 8 (left padding), each batch run to its longest
                output; only each request's own tokens count as useful
    sequential  HF generate, one request at a time

Reports useful output tokens/s of each and the ratios; also how many requests the paged engine
answered token-for-token like sequential ``generate``. Writes ``benchmarks/results/text.json``
(cpu count, torch version, git commit, load average). ``--quick``: 8 requests in [16, 64].
Each process warms up on a 3-token request first. Small shared VMs are noisy (+-20% or
worse): compare ratios from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from walkserve.benchmarking import git_commit

# Idle OpenMP threads sleep instead of spinning (set before torch loads; inherited by the
# per-method processes): spinning threads collapse throughput when the host is shared.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("paged", "static8", "sequential")


def build_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def workload(n: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        new = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append((torch.randint(2, 8192, (length,), generator=g).tolist(), new))
    return out


def run_paged(model_dir: Path, work: list[tuple[list[int], int]], args: Any) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from walkserve.runtime.kv import hf
    from walkserve.runtime.kv.engine import PagedLMEngine

    lm = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation=hf.register()).eval()
    pages = sum(-(-(len(p) + n) // args.page_size) for p, n in work) + 8
    engine = PagedLMEngine(lm, pages, args.page_size, args.max_batch_tokens)
    engine.add_request("warmup", [2, 3, 4], 2)  # first-call costs stay out of the timing
    engine.run()
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(str(i), prompt, n)
    outputs = engine.run()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {
        "seconds": seconds,
        "outputs": [outputs[str(i)] for i in range(len(work))],
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "pool_pages": pages,
    }


def run_generate(model_dir: Path, work: list[tuple[list[int], int]], batch: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():  # first-call costs stay out of the timing
        lm.generate(torch.tensor([[2, 3, 4]]), do_sample=False, max_new_tokens=2, pad_token_id=0)
    outputs: list[list[int]] = []
    slots = 0
    start = time.perf_counter()
    for b in range(0, len(work), batch):
        group = work[b : b + batch]
        longest = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)  # left padding with pad id 0
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        max_new = max(n for _, n in group)
        with torch.no_grad():
            seq = lm.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=0
            )
        slots += len(group) * max_new
        outputs += [seq[row, longest : longest + n].tolist() for row, (_, n) in enumerate(group)]
    return {"seconds": time.perf_counter() - start, "outputs": outputs, "decode_slots": slots}


def worker(args: argparse.Namespace) -> None:
    work = workload(args.requests, args.min_len, args.max_len, args.seed)
    if args.method == "paged":
        result = run_paged(args.model_dir, work, args)
    else:
        result = run_generate(args.model_dir, work, 8 if args.method == "static8" else 1)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, lengths in [16, 64]")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/text.json")
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.min_len, args.max_len = 8, 16, 64
    if args.method:
        worker(args)
        return

    load_before = os.getloadavg()
    work = workload(args.requests, args.min_len, args.max_len, args.seed)
    useful = sum(n for _, n in work)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        for method in METHODS:
            cmd = [sys.executable, __file__, "--method", method, "--model-dir", tmp]
            cmd += ["--requests", str(args.requests), "--seed", str(args.seed)]
            cmd += ["--min-len", str(args.min_len), "--max-len", str(args.max_len)]
            cmd += ["--page-size", str(args.page_size)]
            cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
            load = os.getloadavg()[0]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[method]["loadavg_1min_before"] = load
            tps = useful / results[method]["seconds"]
            results[method]["tokens_per_s"] = tps
            print(f"{method:>10}: {results[method]['seconds']:7.2f} s  {tps:8.1f} tokens/s")
    reference = results["sequential"]["outputs"]
    matches = sum(a == b for a, b in zip(results["paged"]["outputs"], reference))
    for r in results.values():
        del r["outputs"]
    slots = results["static8"]["decode_slots"]
    summary = {
        "benchmark": "text",
        "quick": args.quick,
        "requests": args.requests,
        "length_range": [args.min_len, args.max_len],
        "useful_tokens": useful,
        "results": results,
        "paged_vs_static8": results["paged"]["tokens_per_s"] / results["static8"]["tokens_per_s"],
        "paged_vs_sequential": results["paged"]["tokens_per_s"]
        / results["sequential"]["tokens_per_s"],
        "static8_wasted_decode_slots": 1 - useful / slots,
        "paged_matches_sequential_generate": f"{matches}/{args.requests}",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"paged / static8 = {summary['paged_vs_static8']:.2f}x, "
        f"paged / sequential = {summary['paged_vs_sequential']:.2f}x, "
        f"paged == sequential generate: {matches}/{args.requests}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
