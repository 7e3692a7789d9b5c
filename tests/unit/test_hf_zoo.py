"""The zoo: every architecture of ``adapters.hf_zoo`` (sliding windows, alternating
sliding/full layers, logit soft-capping, attention multipliers, sinks, partial rotary, learned
absolute positions, MoE, key and value head sizes that differ, cross-layer KV sharing, hybrids
with recurrent or linear-attention layers, a vision-language model's text tower) served on the
engine ``hf_engine.text_engine`` picks for it, with 16 concurrent requests, token for token equal
to ``generate(do_sample=False)`` of the model's own eager attention; the paged engine runs all
live requests in one packed forward per step. The fallbacks are asserted with their reasons.
In-process (no workers): ``test_zoo_serve.py`` serves a handful through real workers."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve.adapters import hf_zoo  # noqa: E402
from walkserve.adapters.hf_engine import self_check, text_engine  # noqa: E402
from walkserve.runtime.kv.hf_cache_lm import HFCacheLM  # noqa: E402
from walkserve.runtime.kv.paged_lm import PagedLM, PagedLMConfig  # noqa: E402
from walkserve.testing import greedy_generate, serve_text_greedy  # noqa: E402

EOS = hf_zoo.EOS
KV = PagedLMConfig(pool_tokens=4096, page_size=4)  # pages of 4: windows of 8 span pages
Work = list[tuple[list[int], int]]


def workload(count: int = 16, seed: int = 7) -> Work:
    """``count`` requests: prompts of 1..40 tokens (up to five windows of 8), 1..24 new
    tokens; the first and last of each range always present."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(1, 1), (40, 24)] + [
        (int(torch.randint(1, 41, (1,), generator=g)), int(torch.randint(1, 25, (1,), generator=g)))
        for _ in range(count - 2)
    ]
    return [(torch.randint(3, hf_zoo.VOCAB, (p,), generator=g).tolist(), n) for p, n in lengths]


def generate(lm: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    return greedy_generate(lm, prompt, n, EOS)


def serve_greedy(engine: PagedLM | HFCacheLM, work: Work) -> tuple[list[list[int]], list[int]]:
    return serve_text_greedy(engine, work, EOS)


@pytest.fixture(scope="module")
def work() -> Work:
    return workload()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(hf_zoo.ZOO))
def test_architecture_served_exactly_on_its_engine(name: str, work: Work) -> None:
    entry = hf_zoo.ZOO[name]
    reference = hf_zoo.build(name, attn_implementation="eager")
    want = [generate(reference, p, n) for p, n in work]
    assert len({t for w in want for t in w}) >= 24  # varied output: the check can fail
    engine = text_engine(copy.deepcopy(reference), KV)
    choice = engine.engine_choice
    assert choice.engine == entry.engine, choice.describe()
    assert choice.architecture == entry.model_class
    if entry.engine == "paged":
        assert choice.reason is None
        assert self_check(engine).max_logit_diff < 1e-4
    else:
        why = entry.reason_words(transformers.__version__)
        assert choice.reason is not None and why in choice.reason, choice.reason
    got, sizes = serve_greedy(engine, work)
    assert got == want
    if isinstance(engine, PagedLM):
        assert max(sizes) == len(work)  # every request's step in one forward
        stats = engine.kv_stats()
        assert stats is not None and stats.evictions == 0
        del engine
