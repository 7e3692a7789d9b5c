"""Text generation, walkserve against every baseline and the roofline:
``python benchmarks/bench_text_suite.py [--quick | --full]``.

The workload of ``bench_text.py``: a ~35M-parameter random Llama (hidden 512, 8 layers, 8
heads, 4 KV heads, vocab 8192, fp32, no EOS) saved with a word-level tokenizer to a temporary
directory, ``--requests`` (32) requests with prompt and output lengths uniform in ``[16, 256]``
(seeded), greedy. Every method runs in a fresh process (repeated ``generate`` calls in one
process slow down on small VMs) after a 3-token warm-up request:

    http        walkserve over HTTP: ``walkserve serve --model DIR --threads T`` as a
                subprocess, driven by the load generator (streamed completions), closed loop at
                concurrency 32; T is the torch threads every in-process method below computes
                with (torch's default here: the cores), so that the ratios compare the paths,
                not the threads
    http_default  the same with the server's default worker threads (the cores but one: a
                core stays with the server process), what ``walkserve serve`` gives unasked
    paged       walkserve's in-process ``PagedLMEngine``, all requests submitted at once; its
                model forwards are also timed alone (``paged_forward_only``: the same batches
                with the scheduler, sampling and bookkeeping taken out)
    static8     HF ``generate``, static batches of 8 (left padding), run to each batch's longest
    sequential  HF ``generate``, one request at a time
    hf_cb       transformers' own continuous batching (``ContinuousBatchingManager``) with
                explicit page size, block count and batch limits (it cannot size them on CPU)
    bare        the same HF forward at batch 32 on the same requests with nothing around it:
                one left-padded prefill, then a greedy decode step per token on a
                ``DynamicCache``, finished rows dropped; the runtime-overhead baseline
    roofline    not a method: measured read bandwidth and fp32 matmul FLOP/s here, and the
                bytes read and FLOPs of an ideal schedule of this workload (one prefill, then
                every unfinished request decoding together, each step bounded by the slower of
                its memory traffic and its arithmetic); its tokens/s is an upper bound

Reports useful output tokens/s of each (only each request's own tokens count), walkserve's
ratios to each baseline, each method's time overhead over the bare loop (and walkserve's over
its own forwards), each method's
fraction of the roofline, and how many requests each method answered token-for-token like
sequential ``generate``. Writes ``benchmarks/results/text_suite.json`` and its plot.
``--quick``: 8 requests in [16, 64] (concurrency 8). ``--full``: the 32-request workload and
also concurrency 8 and 16 over HTTP. Small shared VMs are noisy: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by every method's process

import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("walkserve") is None or importlib.util.find_spec("benchmarks") is None:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_text import build_model, run_generate, workload  # noqa: E402
from walkserve.benchmarking import machine_info  # noqa: E402


@dataclass(frozen=True)
class LlamaShape:
    """The benchmark model's shape (``bench_text.build_model``), for the roofline's counts."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 8192


SHAPE = LlamaShape()
METHODS = ("http", "http_default", "paged", "static8", "sequential", "hf_cb", "bare")
Work = list[tuple[list[int], int]]


def build_checkpoint(path: Path) -> None:
    """The benchmark Llama plus a word-level tokenizer (token ``t<i>`` is id i), so that
    ``walkserve serve --model DIR`` can load it like any local checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    build_model(path)
    vocab = {f"t{i}": i for i in range(8192)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")
    fast.save_pretrained(path)


# ---------------------------------------------------------------------------- methods


def run_http(model_dir: Path, work: Work, concurrency: int, threads: int | None) -> dict[str, Any]:
    """``threads``: the worker's torch threads (None: the server's default)."""
    from benchmarks import loadgen

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "walkserve.cli", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the server)
    # the checkout's walkserve, also when it is not installed
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        model = loadgen.served_model(url)

        def planned(i: int, prompt: list[int], n: int, warmup: bool) -> loadgen.Planned:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": n,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            }
            return loadgen.Planned(i, "text", "/v1/completions", body, len(prompt), n, warmup)

        requests = [planned(-1, [2, 3, 4], 2, True)]
        requests += [planned(i, p, n, False) for i, (p, n) in enumerate(work)]
        arrivals = loadgen.Arrivals(concurrency=concurrency)
        records, wall = asyncio.run(loadgen.run(url, requests, arrivals, timeout=1800))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} HTTP requests failed, first: {failed[0]}")
    summary = loadgen.summarize(records, wall)["overall"]
    return {
        "seconds": wall,
        "outputs": [r.token_ids for r in records],
        "concurrency": concurrency,
        "ttft_s": summary["first_s"],
        "tpot_s": summary["tpot_s"],
        "e2e_s": summary["e2e_s"],
    }


def _wait_healthy(proc: subprocess.Popen[str], url: str, log: Any) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"walkserve serve exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("walkserve serve did not become healthy in 300 s")
        time.sleep(0.2)


def run_paged_timed(model_dir: Path, work: Work, args: Any) -> dict[str, Any]:
    """``bench_text.run_paged`` with the engine's model forwards timed on their own: the
    forward-only time is the same batches with the scheduler, sampling and bookkeeping taken
    out (the sharpest bare baseline for the runtime's own overhead)."""
    from transformers import LlamaForCausalLM

    from walkserve.runtime.kv import hf
    from walkserve.runtime.kv.engine import PagedLMEngine

    lm = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation=hf.register()).eval()
    pages = sum(-(-(len(p) + n) // args.page_size) for p, n in work) + 8
    engine = PagedLMEngine(lm, pages, args.page_size, args.max_batch_tokens)
    engine.add_request("warmup", [2, 3, 4], 2)  # first-call costs stay out of the timing
    engine.run()
    forward = engine.runner.forward
    spent = [0.0]

    def timed(chunks: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = forward(chunks)
        spent[0] += time.perf_counter() - t0
        return out

    engine.runner.forward = timed  # type: ignore[method-assign]
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(str(i), prompt, n)
    outputs = engine.run()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {
        "seconds": seconds,
        "forward_seconds": spent[0],
        "outputs": [outputs[str(i)] for i in range(len(work))],
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "pool_pages": pages,
    }


def run_hf_cb(model_dir: Path, work: Work, args: Any) -> dict[str, Any]:
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    lm = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    page = args.cb_page_size
    blocks = sum(-(-(len(p) + n) // page) for p, n in work) + 8
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=len(work),
        auto_switch_to_flash=False,
        use_cuda_graph=False,
        use_async_batching=False,
        allow_block_sharing=False,
    )
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work))
    gen.eos_token_id, gen.pad_token_id = None, 0
    with lm.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        ids = {"warmup": manager.add_request([2, 3, 4], "warmup", max_new_tokens=2)}
        _collect(manager, ids)
        start = time.perf_counter()
        ids = {
            str(i): manager.add_request(p, f"r{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(work)
        }
        results = _collect(manager, ids)
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "outputs": [results[f"r{i}"] for i in range(len(work))],
        "page_size": page,
        "num_blocks": blocks,
    }


def _collect(manager: Any, ids: dict[str, Any]) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.error is not None:
            raise RuntimeError(f"continuous batching request failed: {result.error}")
        if result.is_finished():
            done[result.request_id] = list(result.generated_tokens)
    return done


@torch.no_grad()
def run_bare(model_dir: Path, work: Work) -> dict[str, Any]:
    from transformers import DynamicCache, LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()

    def generate(group: Work) -> tuple[list[list[int]], int]:
        longest = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)  # [B, T] left padded
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        cache = DynamicCache(config=lm.config)
        logits = lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            logits_to_keep=1,
        ).logits  # [B, 1, V]
        token = logits[:, -1].argmax(-1)  # [B]
        outputs: list[list[int]] = [[int(t)] for t in token]
        rows = list(range(len(group)))  # rows of the running batch -> request
        steps = 0
        while True:
            keep = [k for k, r in enumerate(rows) if len(outputs[r]) < group[r][1]]
            if not keep:
                return outputs, steps
            if len(keep) < len(rows):  # drop finished rows from the batch and the cache
                index = torch.tensor(keep)
                cache.batch_select_indices(index)
                mask, positions, token = mask[index], positions[index], token[index]
                rows = [rows[k] for k in keep]
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
            positions = positions[:, -1:] + 1  # [b, 1]
            logits = lm(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
            ).logits  # [b, 1, V]
            token = logits[:, -1].argmax(-1)
            for k, r in enumerate(rows):
                outputs[r].append(int(token[k]))
            steps += 1

    generate([([2, 3, 4], 2)])  # first-call costs stay out of the timing
    start = time.perf_counter()
    outputs, steps = generate(work)
    return {"seconds": time.perf_counter() - start, "outputs": outputs, "decode_steps": steps}


# ---------------------------------------------------------------------------- roofline


def measure_machine() -> dict[str, float]:
    """Best-of-5 read bandwidth (sum of a 256 MiB tensor), copy bandwidth, and fp32 matmul
    FLOP/s (1024^3 square, and the decode shape [32, 512] x [512, 1536])."""

    def best(fn: Any, reps: int = 5) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    x = torch.ones(64 << 20)  # 256 MiB fp32
    y = torch.empty_like(x)
    read = x.numel() * 4 / best(lambda: x.sum())
    copy = 2 * x.numel() * 4 / best(lambda: y.copy_(x))
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    square = 2 * 1024**3 / best(lambda: a @ b, 10)
    h, w = torch.randn(32, 512), torch.randn(512, 1536)
    decode = 2 * 32 * 512 * 1536 / best(lambda: h @ w, 200)
    return {
        "read_bytes_per_s": read,
        "copy_bytes_per_s": copy,
        "matmul_flops_per_s": square,
        "decode_matmul_flops_per_s": decode,
    }


def roofline(work: Work, machine: dict[str, float]) -> dict[str, Any]:
    """The fastest this workload can run here: an ideal schedule (one prefill of every prompt,
    then all unfinished requests decoding together), each step taking the longer of its bytes
    read over the measured bandwidth and its FLOPs over the measured matmul rate."""
    c = SHAPE
    hd = c.hidden_size // c.num_attention_heads
    per_layer = (
        c.hidden_size * c.hidden_size * 2  # q, o
        + c.hidden_size * c.num_key_value_heads * hd * 2  # k, v
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
        + 2 * c.hidden_size  # norms
    )
    matmul_params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size
    kv_bytes_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * hd * 4
    attn_flops_per_ctx = c.num_hidden_layers * 4 * c.num_attention_heads * hd  # QK^T and AV
    bw, flops = machine["read_bytes_per_s"], machine["matmul_flops_per_s"]

    prompts = [len(p) for p, _ in work]
    prefill_flops = 2 * matmul_params * sum(prompts) + sum(
        attn_flops_per_ctx * p * (p + 1) / 2 for p in prompts
    )
    prefill_s = max(prefill_flops / flops, 4 * matmul_params / bw)
    decode_s, steps, bound_by_memory = 0.0, 0, 0
    for s in range(1, max(n for _, n in work)):
        active = [(len(p) + s) for p, n in work if n > s]  # contexts of the requests decoding
        if not active:
            break
        step_bytes = 4 * matmul_params + kv_bytes_per_token * sum(active)
        step_flops = 2 * matmul_params * len(active) + attn_flops_per_ctx * sum(active)
        t_mem, t_flop = step_bytes / bw, step_flops / flops
        decode_s += max(t_mem, t_flop)
        bound_by_memory += t_mem >= t_flop
        steps += 1
    useful = sum(n for _, n in work)
    # the steady state the issue names: batch = all requests, context = mean prompt + half output
    b = len(work)
    ctx = sum(prompts) / b + sum(n for _, n in work) / (2 * b)
    steady = max(
        (4 * matmul_params + kv_bytes_per_token * ctx * b) / bw,
        (2 * matmul_params * b + attn_flops_per_ctx * ctx * b) / flops,
    )
    return {
        "parameters_in_matmuls": matmul_params,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": steps,
        "decode_steps_memory_bound": bound_by_memory,
        "tokens_per_s": useful / (prefill_s + decode_s),
        "steady_state": {
            "batch": b,
            "context": ctx,
            "step_s": steady,
            "tokens_per_s": b / steady,
        },
    }


# ---------------------------------------------------------------------------- driver


def compare(results: dict[str, dict[str, Any]], roof: dict[str, Any]) -> dict[str, Any]:
    """Ratios between the methods that ran (those with ``tokens_per_s``): walkserve's (http,
    paged) tokens/s over each other method's, each method's time overhead over the bare loop
    and walkserve's over its own forwards (time / baseline time - 1), and each method's
    fraction of the roofline."""
    ok = {k: r for k, r in results.items() if "tokens_per_s" in r}
    comparisons: dict[str, Any] = {}
    for base, key in (("http", "walkserve_http_vs"), ("paged", "paged_vs")):
        if base in ok:
            comparisons[key] = {
                k: ok[base]["tokens_per_s"] / r["tokens_per_s"] for k, r in ok.items() if k != base
            }
    if "bare" in ok:
        comparisons["time_overhead_vs_bare"] = {
            k: ok["bare"]["tokens_per_s"] / r["tokens_per_s"] - 1 for k, r in ok.items()
        }
    if "paged_forward_only" in ok:
        comparisons["time_overhead_vs_paged_forward"] = {
            k: ok["paged_forward_only"]["tokens_per_s"] / r["tokens_per_s"] - 1
            for k, r in ok.items()
            if k in ("http", "http_default", "paged")
        }
    if "tokens_per_s" in roof:
        comparisons["fraction_of_roofline"] = {
            k: r["tokens_per_s"] / roof["tokens_per_s"] for k, r in ok.items()
        }
    return comparisons


def worker(args: argparse.Namespace) -> None:
    work = workload(args.requests, args.min_len, args.max_len, args.seed)
    if args.method == "roofline":
        result: dict[str, Any] = measure_machine()
    elif args.method in ("http", "http_default"):
        from walkserve.runtime.config import default_threads

        # the threads every in-process method computes with: torch's default in this process
        threads = torch.get_num_threads() if args.method == "http" else None
        result = run_http(args.model_dir, work, args.concurrency, threads)
        result["worker_threads"] = threads if threads is not None else default_threads(1)
    elif args.method == "paged":
        result = run_paged_timed(args.model_dir, work, args)
    elif args.method == "hf_cb":
        result = run_hf_cb(args.model_dir, work, args)
    elif args.method == "bare":
        result = run_bare(args.model_dir, work)
    else:
        result = run_generate(args.model_dir, work, 8 if args.method == "static8" else 1)
    print(json.dumps(result))


def run_method(args: argparse.Namespace, method: str, model_dir: str, **extra: Any) -> Any:
    cmd = [sys.executable, __file__, "--method", method, "--model-dir", model_dir]
    cmd += ["--requests", str(args.requests), "--seed", str(args.seed)]
    cmd += ["--min-len", str(args.min_len), "--max-len", str(args.max_len)]
    cmd += ["--page-size", str(args.page_size), "--cb-page-size", str(args.cb_page_size)]
    cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    cmd += ["--concurrency", str(extra.get("concurrency", args.concurrency))]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.method_timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-1500:], "loadavg_1min_before": load}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["loadavg_1min_before"] = load
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="8 requests, lengths in [16, 64]")
    size.add_argument("--full", action="store_true", help="also HTTP at concurrency 8 and 16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, help="HTTP clients (default: --requests)")
    parser.add_argument("--page-size", type=int, default=16, help="PagedLMEngine page tokens")
    parser.add_argument("--cb-page-size", type=int, default=64, help="transformers CB page")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}"
    )
    parser.add_argument("--method-timeout", type=float, default=1800, help="seconds per method")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/text_suite.json")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.min_len, args.max_len = 8, 16, 64
    if args.concurrency is None:
        args.concurrency = min(32, args.requests)
    if args.method:
        worker(args)
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")

    info_before = machine_info()
    work = workload(args.requests, args.min_len, args.max_len, args.seed)
    useful = sum(n for _, n in work)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp))
        machine = run_method(args, "roofline", tmp)
        runs: list[tuple[str, str, dict[str, int]]] = [(m, m, {}) for m in methods]
        if args.full and "http" in methods:
            runs += [
                (f"http_c{c}", "http", {"concurrency": c}) for c in (8, 16) if c < args.requests
            ]
        for name, method, extra in runs:
            results[name] = run_method(args, method, tmp, **extra)
            r = results[name]
            if "error" in r:
                print(f"{name:>12}: FAILED: {r['error'].splitlines()[-1] if r['error'] else ''}")
                continue
            r["tokens_per_s"] = useful / r["seconds"]
            print(f"{name:>12}: {r['seconds']:7.2f} s  {r['tokens_per_s']:8.1f} tokens/s")
        # the limit is the best the machine showed: measure again after the methods (a shared
        # host's load changes) and keep the higher of each figure
        again = run_method(args, "roofline", tmp)
        if "error" not in machine and "error" not in again:
            machine = {k: max(v, again[k]) for k, v in machine.items() if k in again}
    paged = results.get("paged", {})
    if "forward_seconds" in paged:
        results["paged_forward_only"] = {
            "seconds": paged["forward_seconds"],
            "tokens_per_s": useful / paged["forward_seconds"],
            "derived_from": "paged: its model forwards alone, timed inside the paged run",
        }
    roof = roofline(work, machine) if "error" not in machine else {"error": machine["error"]}
    reference = results.get("sequential", {}).get("outputs")
    for name, r in results.items():
        outputs = r.pop("outputs", None)
        if reference is not None and outputs is not None and name != "sequential":
            same = sum(a == b for a, b in zip(outputs, reference))
            r["matches_sequential_generate"] = f"{same}/{len(reference)}"
    comparisons = compare(results, roof)
    summary = {
        "benchmark": "text_suite",
        "quick": args.quick,
        "full": args.full,
        "requests": args.requests,
        "length_range": [args.min_len, args.max_len],
        "useful_tokens": useful,
        "model": "Llama, hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8192, fp32 (random)",
        "machine": machine,
        "roofline": roof,
        "results": results,
        **comparisons,
        **info_before,
        "load_average_after": list(os.getloadavg()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    if "tokens_per_s" in roof:
        print(
            f"roofline {roof['tokens_per_s']:.0f} tokens/s (read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s,"
            f" matmul {machine['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s)"
        )
    for key in (
        "walkserve_http_vs",
        "time_overhead_vs_bare",
        "time_overhead_vs_paged_forward",
        "fraction_of_roofline",
    ):
        if key in comparisons:
            print(f"{key}: " + ", ".join(f"{k} {v:.2f}" for k, v in comparisons[key].items()))
    try:
        from benchmarks.plots import plot_result

        print(f"wrote {args.out} and {plot_result(args.out)}")
    except ImportError as e:
        print(f"wrote {args.out} (no plot: {e})")


if __name__ == "__main__":
    main()
