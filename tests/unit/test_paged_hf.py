"""Unmodified transformers Llama / Qwen2 / Qwen3 on the paged KV pool: many requests batched in
one packed forward per step, token-exact against ``generate(do_sample=False)`` per request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve.runtime.kv import hf  # noqa: E402
from walkserve.runtime.kv.engine import PagedLMEngine  # noqa: E402
from walkserve.runtime.kv.pool_types import SeqId  # noqa: E402

EOS = 5
ARCHS = ["llama", "qwen2", "qwen3"]


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=512,
        initializer_range=0.15,  # varied greedy output from random weights
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
    )
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))


@pytest.fixture(scope="module", params=ARCHS)
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(reference model with sdpa, the same checkpoint with the paged attention function)."""
    path: Path = tmp_path_factory.mktemp(request.param)
    tiny(request.param).save_pretrained(path)
    cls = type(tiny(request.param))
    ref = cls.from_pretrained(path, attn_implementation="sdpa").eval()
    paged = cls.from_pretrained(path, attn_implementation=hf.register()).eval()
    return ref, paged


@pytest.fixture(scope="module")
def workload(models) -> list[tuple[list[int], int, list[int]]]:
    """16 seeded requests, prompts of 1..300 tokens, 1..200 new tokens, with generate's answer."""
    ref, _ = models
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(16):
        length = int(torch.randint(1, 301, (1,), generator=g))
        n = int(torch.randint(1, 201, (1,), generator=g))
        prompt = torch.randint(6, 128, (length,), generator=g).tolist()
        out.append((prompt, n, reference(ref, prompt, n)))
    return out


def reference(lm: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = lm.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    return seq[0, ids.shape[1] :].tolist()


def run_all(engine: PagedLMEngine, work: list[tuple[list[int], int, list[int]]]) -> None:
    for i, (prompt, n, _) in enumerate(work):
        engine.add_request(f"r{i}", prompt, n, eos=EOS)
    outputs = engine.run()
    for i, (_, _, want) in enumerate(work):
        assert outputs[f"r{i}"] == want, f"request r{i}"
    assert engine.stats().pages_in_use == 0


def test_packed_prefill_and_decode_match_sdpa_logits(models) -> None:
    """One forward with two prefills and a chunked continuation equals full-sequence logits:
    RoPE and Qwen3's q/k norm are transformers' own."""
    ref, paged = models
    pool = hf.pool_for(paged, 16, 8)
    runner = hf.PagedCausalLMRunner(paged, pool)
    a, b = list(range(6, 26)), list(range(40, 53))
    pool.allocate(("a", "t"), len(a))
    pool.allocate(("b", "t"), len(b))
    sa, sb = SeqId("a", "t"), SeqId("b", "t")
    first = runner.forward([hf.SeqChunk(tuple(a[:12]), 0, sa), hf.SeqChunk(tuple(b), 0, sb)])
    second = runner.forward([hf.SeqChunk(tuple(a[12:]), 12, sa)])
    with torch.no_grad():
        want_a = ref(torch.tensor([a])).logits[0]
        want_b = ref(torch.tensor([b])).logits[0]
    torch.testing.assert_close(first[0], want_a[11], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first[1], want_b[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[0], want_a[-1], atol=1e-5, rtol=1e-5)


def test_attention_outside_a_step_is_refused(models) -> None:
    _, paged = models
    with pytest.raises(RuntimeError, match="paged step"):
        paged(torch.tensor([[7, 8]]), use_cache=False)


@pytest.mark.slow
def test_sixteen_concurrent_requests_match_generate(models, workload) -> None:
    _, paged = models
    engine = PagedLMEngine(paged, pool_pages=512, page_size=16, max_batch_tokens=512)
    run_all(engine, workload)
    assert engine.stats().preemptions == 0


@pytest.mark.slow
def test_small_pool_preempts_and_still_matches(models, workload) -> None:
    _, paged = models
    engine = PagedLMEngine(paged, pool_pages=40, page_size=16, max_batch_tokens=256)
    run_all(engine, workload)
    assert engine.stats().preemptions > 0


@pytest.mark.slow
def test_prefix_pages_are_reused_and_match(models) -> None:
    ref, paged = models
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(6, 128, (100,), generator=g).tolist()
    work = []
    for i in range(6):
        prompt = shared + torch.randint(6, 128, (5 + 7 * i,), generator=g).tolist()
        work.append((prompt, 20, reference(ref, prompt, 20)))
    engine = PagedLMEngine(paged, pool_pages=128, page_size=16, max_batch_tokens=512)
    prompt, n, want = work[0]
    engine.add_request("first", prompt, n, eos=EOS)  # computes and registers the shared pages
    assert engine.run()["first"] == want
    run_all(engine, work[1:])
    assert engine.stats().prefix_hits >= 5 * (len(shared) // 16)
    assert engine.stats().pages_cached > 0


def test_cancel_frees_pages(models) -> None:
    _, paged = models
    engine = PagedLMEngine(paged, pool_pages=64, page_size=8, max_batch_tokens=64)
    for i in range(4):
        engine.add_request(f"c{i}", list(range(6, 6 + 10 * (i + 1))), 50)
    engine.step()
    engine.step()
    assert engine.stats().pages_in_use > 0
    assert engine.cancel("c0") and engine.cancel("c3")
    assert not engine.cancel("c0")
    for request_id in ("c1", "c2"):
        engine.cancel(request_id)
    assert not engine.has_unfinished()
    assert engine.stats().pages_in_use == 0
    assert engine.stats().cancelled == 4


def test_request_larger_than_the_pool_is_refused(models) -> None:
    _, paged = models
    engine = PagedLMEngine(paged, pool_pages=4, page_size=8, max_batch_tokens=64)
    with pytest.raises(ValueError, match="bigger pool"):
        engine.add_request("big", list(range(6, 40)), 10)
