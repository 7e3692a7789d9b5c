"""``PagedLM``: one packed forward for many requests' prefill and decode calls, token-exact
against transformers' own ``generate``; eviction and recompute when the pool is full; seeded
sampling that does not depend on the batch; pages freed when a cache is dropped."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve.lowering.batched import DEFER  # noqa: E402
from walkserve.runtime.kv.paged_lm import PagedKV, PagedLM, PagedLMConfig  # noqa: E402

EOS = 5


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def generate(lm: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = lm.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
        )
    return out[0, len(ids) :].tolist()


def call(ids: Any, cache: PagedKV | None, step: Any = 0, **sampling: Any) -> tuple[Any, dict]:
    args = (ids, cache, step, *(sampling.get(k, d) for k, d in SAMPLING_DEFAULTS))
    return args, {}


SAMPLING_DEFAULTS = (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("seed", 0))


def run_batched(lm: PagedLM, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """What the runtime does: every unfinished request's next call in one batch per step, a
    deferred call sent again the next step. Returns the tokens and how many calls deferred."""
    tokens: list[list[int]] = [[] for _ in prompts]
    caches: list[PagedKV | None] = [None for _ in prompts]
    deferred = 0
    while any(len(t) < n for t in tokens):
        live = [i for i, t in enumerate(tokens) if len(t) < n]
        batch = [
            call(torch.tensor([tokens[i][-1:] or prompts[i]]), caches[i], len(tokens[i]))
            for i in live
        ]
        for i, out in zip(live, lm.forward_batch(batch), strict=True):
            if out is DEFER:
                deferred += 1
                continue
            token, caches[i] = out
            tokens[i].append(int(token))
    return tokens, deferred


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(6, 128, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def test_packed_prefill_and_decode_match_generate() -> None:
    upstream, lm = tiny(), PagedLM(tiny(), PagedLMConfig(pool_tokens=4096, page_size=8))
    ps = prompts(6)
    got, deferred = run_batched(lm, ps, 12)
    assert got == [generate(upstream, p, 12) for p in ps] and deferred == 0
    stats = lm.kv_stats()
    assert stats is not None and stats.evictions == 0
    assert stats.forwards == 12  # one packed forward per step for all six requests


def test_a_pool_too_small_defers_and_preempts_exactly() -> None:
    upstream = tiny()
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=64, page_size=8))  # 8 pages
    ps = prompts(6, seed=2)
    got, deferred = run_batched(lm, ps, 10)
    assert got == [generate(upstream, p, 10) for p in ps]
    stats = lm.kv_stats()
    assert stats is not None and deferred > 0  # requests waited for room


def test_running_requests_that_outgrow_the_pool_are_preempted_and_recomputed() -> None:
    """Two requests admitted together, then both grow past the pool: the younger is preempted
    (its pages freed), waits, and is recomputed from its tokens; both stay exact."""
    upstream = tiny()
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=48, page_size=8))  # 6 pages
    ps = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]]  # 1 page each
    got, deferred = run_batched(lm, ps, 20)  # 26 tokens each: 4 pages each at the end
    assert got == [generate(upstream, p, 20) for p in ps]
    stats = lm.kv_stats()
    assert stats is not None and stats.evictions > 0 and deferred > 0


def test_a_sequence_longer_than_the_pool_is_a_clear_error() -> None:
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=16, page_size=8))
    with pytest.raises(ValueError, match="bigger pool_tokens"):
        lm.forward_batch([call(torch.arange(6, 30).unsqueeze(0), None)])


def test_prefix_pages_are_shared_across_requests() -> None:
    upstream, lm = tiny(), PagedLM(tiny(), PagedLMConfig(pool_tokens=1024, page_size=4))
    shared = list(range(10, 30))
    a, _ = run_batched(lm, [[*shared, 40, 41]], 4)
    b, _ = run_batched(lm, [[*shared, 50]], 4)
    stats = lm.kv_stats()
    assert stats is not None and stats.prefix_hits >= 4  # 20 shared tokens: 5 full pages
    assert a[0] == generate(upstream, [*shared, 40, 41], 4)
    assert b[0] == generate(upstream, [*shared, 50], 4)


def test_sampling_is_seeded_and_independent_of_the_batch() -> None:
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=2048, page_size=8))
    p = [7, 8, 9, 10]
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 11}

    def draw(others: int, **kw: Any) -> list[int]:
        calls = [call(torch.tensor([p]), None, **kw)]
        calls += [call(torch.tensor([[20 + i, 21]]), None) for i in range(others)]
        token, cache = lm.forward_batch(calls)[0]
        out = [int(token)]
        for step in range(1, 8):
            token, cache = lm.forward_batch([call(token, cache, torch.tensor([[step]]), **kw)])[0]
            out.append(int(token))
        return out

    alone, crowded = draw(0, **sampling), draw(3, **sampling)
    assert alone == crowded
    assert draw(0, **{**sampling, "seed": 12}) != alone
    greedy = draw(0)
    assert draw(0, temperature=0.7, top_k=1, seed=3) == greedy  # top-1 is argmax


def test_pages_are_freed_when_caches_are_dropped() -> None:
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=512, page_size=8))
    outs = lm.forward_batch([call(torch.tensor([p]), None) for p in prompts(4)])
    stats = lm.kv_stats()
    assert stats is not None and stats.pages_in_use > 0 and stats.live_sequences == 4
    del outs
    gc.collect()
    stats = lm.kv_stats()
    assert stats is not None and stats.pages_in_use == 0 and stats.live_sequences == 0


def test_a_release_while_a_forward_runs_is_done_at_the_next_one() -> None:
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=512, page_size=8))
    (_, cache), *_ = lm.forward_batch([call(torch.tensor([[6, 7, 8]]), None)])
    state = lm._state
    assert state is not None
    with state.lock:  # as if the worker's main thread were in a forward
        del cache
        gc.collect()
        assert state.pending  # queued, not blocked
    stats = lm.kv_stats()
    assert stats is not None and stats.pages_in_use == 0


def test_bad_calls_are_refused() -> None:
    lm, other = PagedLM(tiny()), PagedLM(tiny())
    (_, cache), *_ = other.forward_batch([call(torch.tensor([[6, 7]]), None)])
    with pytest.raises(ValueError, match="made by this component"):
        lm.forward_batch([call(torch.tensor([[1]]), cache)])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens >= 1\]"):
        lm.forward_batch([call(torch.tensor([1, 2]), None)])
    with pytest.raises(ValueError, match="rows"):
        other.forward_batch([call(torch.tensor([[1], [2]]), cache)])


def test_chunked_prefill_lets_short_requests_finish_while_a_long_prompt_runs() -> None:
    """``max_step_tokens`` 32: a 300-token prompt arriving with three short requests is
    computed 24-32 tokens a forward (whole pages, answered DEFER until its last chunk), and
    the short ones get a token every forward meanwhile: all three finish before the long
    one's first token. Every token is generate()'s; no forward computes more than 32."""
    upstream = tiny()
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=1024, page_size=8, max_step_tokens=32))
    long_prompt = [6 + (7 * k) % 120 for k in range(300)]
    ps = [long_prompt, *prompts(3, seed=4)]
    n = 6
    tokens: list[list[int]] = [[] for _ in ps]
    caches: list[PagedKV | None] = [None for _ in ps]
    finished: list[int] = []  # request indexes in the order they finish
    first_token_step: dict[int, int] = {}
    per_forward: list[int] = []
    step = 0
    while any(len(t) < n for t in tokens):
        live = [i for i, t in enumerate(tokens) if len(t) < n]
        batch = [
            call(torch.tensor([tokens[i][-1:] or ps[i]]), caches[i], len(tokens[i])) for i in live
        ]
        before = lm.kv_stats()
        outs = lm.forward_batch(batch)
        after = lm.kv_stats()
        assert after is not None
        per_forward.append(after.tokens_forwarded - (before.tokens_forwarded if before else 0))
        for i, out in zip(live, outs, strict=True):
            if out is DEFER:
                continue
            token, caches[i] = out
            tokens[i].append(int(token))
            first_token_step.setdefault(i, step)
            if len(tokens[i]) == n:
                finished.append(i)
        step += 1
    assert tokens == [generate(upstream, p, n) for p in ps]
    assert max(per_forward) <= 32
    assert finished[-1] == 0
    assert all(first_token_step[0] > first_token_step[i] + n - 1 for i in (1, 2, 3))
    assert first_token_step[0] >= 300 // 32  # the prompt took many forwards, not one


def test_chunked_calls_on_a_running_cache_and_of_several_rows_are_exact() -> None:
    """A running cache fed 60 new tokens in one call (a continuation) and a new call of two
    rows of 70 tokens each, under a budget of 16 tokens a forward: each deferred until done,
    then the token generate() gives for the whole sequence."""
    upstream = tiny()
    lm = PagedLM(tiny(), PagedLMConfig(pool_tokens=1024, page_size=8, max_step_tokens=16))
    first = prompts(1, seed=5)[0][:10]
    (token, cache), *_ = lm.forward_batch([call(torch.tensor([first]), None)])
    more = list(range(20, 80))
    rows = torch.tensor([list(range(6, 76)), list(range(40, 110))])
    todo = {
        "continue": call(torch.tensor([more]), cache, 1),
        "rows": call(rows, None),
    }
    got: dict[str, Any] = {}
    forwards = 0
    while todo:
        names = list(todo)
        forwards += 1
        for name, out in zip(names, lm.forward_batch([todo[n] for n in names]), strict=True):
            if out is not DEFER:
                got[name] = out[0]
                del todo[name]
    assert forwards >= (60 + 140) // 16
    assert int(got["continue"]) == generate(upstream, [*first, int(token), *more], 1)[0]
    assert got["rows"].view(-1).tolist() == [generate(upstream, r, 1)[0] for r in rows.tolist()]
