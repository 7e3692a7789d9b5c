"""The fallback text engine ``HFCacheLM``: the model's own cache per request, never shared
between two requests whose calls arrive in one batch, and misuse refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from walkserve.adapters import hf_zoo
from walkserve.runtime.kv.hf_cache_lm import HFCacheLM
from walkserve.testing import greedy_generate


def test_calls_of_one_batch_keep_their_own_caches() -> None:
    lm = hf_zoo.build("falcon")
    engine = HFCacheLM(lm, reason="test")
    a, b = [5, 9, 11, 40], [7, 8, 30, 41]  # one length: a runtime group would join them
    out = engine.forward_batch(
        [((torch.tensor([a]), None, 0), {}), ((torch.tensor([b]), None, 0), {})]
    )
    (ta, ca), (tb, cb) = out
    assert ca is not cb and len(ca) == len(cb) == 1
    got = [[int(ta)], [int(tb)]]
    for _ in range(5):
        (ta, ca), (tb, cb) = engine.forward_batch([((ta, ca, 1), {}), ((tb, cb, 1), {})])
        got[0].append(int(ta))
        got[1].append(int(tb))
    assert got == [greedy_generate(lm, p, 6, None) for p in (a, b)]
    assert engine.engine_choice.engine == "hf-cache" and engine.engine_choice.reason == "test"


def test_misuse_is_refused() -> None:
    engine = HFCacheLM(hf_zoo.build("llama"))
    _, cache = engine(torch.tensor([[5, 6], [7, 8]]))
    with pytest.raises(ValueError, match="2 rows, input_ids 1"):
        engine(torch.tensor([[1]]), cache)
    with pytest.raises(ValueError, match="made by this component"):
        HFCacheLM(engine.lm)(torch.tensor([[1], [2]]), cache)
    with pytest.raises(ValueError, match="input_ids must be"):
        engine(torch.tensor([1, 2]))
