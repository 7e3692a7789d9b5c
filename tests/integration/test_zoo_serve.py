"""A handful of the zoo's architectures (``adapters.hf_zoo``) saved as checkpoint directories and
served by real worker processes, 16 concurrent requests each: every request's tokens equal
``generate(do_sample=False)``. The paged ones share forwards (the batch-size histogram), the
fallback one does not; each server's model reports its engine. The rest of the zoo is checked
in-process (``tests/unit/test_hf_zoo.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve.adapters import hf_zoo  # noqa: E402
from walkserve.adapters.hf_causal_lm import sample_request  # noqa: E402
from walkserve.runtime.kv.engine_report import engine_choices  # noqa: E402
from walkserve.runtime.server import serve  # noqa: E402
from walkserve.runtime.workers import PoolConfig  # noqa: E402
from walkserve.testing import greedy_generate  # noqa: E402

SERVED = {
    "gemma2": "paged",  # soft cap, query_pre_attn_scalar, alternating sliding/full
    "gpt-oss": "paged",  # sinks, sliding/full, MoE
    "deepseek-v3": "paged",  # key heads 12, value heads 6
    "jamba": "hf-cache",  # Mamba layers: the fallback
}


def workload(seed: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [(1, 1), (40, 24)] + [
        (int(torch.randint(1, 41, (1,), generator=g)), int(torch.randint(1, 25, (1,), generator=g)))
        for _ in range(14)
    ]
    return [(torch.randint(3, hf_zoo.VOCAB, (p,), generator=g).tolist(), n) for p, n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SERVED))
def test_sixteen_concurrent_requests_match_generate(name: str, tmp_path: Path) -> None:
    reference = hf_zoo.build(name, attn_implementation="eager")
    reference.save_pretrained(tmp_path)
    work = workload(seed=len(name))
    want = [greedy_generate(reference, p, n, hf_zoo.EOS) for p, n in work]
    with serve(str(tmp_path), pool_config=PoolConfig(kv_page_size=4)) as server:
        (choice,) = engine_choices(server.captured.model).values()
        assert choice.engine == SERVED[name] and choice.architecture == hf_zoo.ZOO[name].model_class
        handles = [server.submit(sample_request(p, n)) for p, n in work]  # all in flight
        got = []
        for h in handles:
            out = h.result(timeout=600)
            tokens = [int(out["token"])] + (out["tokens"][0].tolist() if "tokens" in out else [])
            got.append(tokens)
        assert got == want
        if choice.engine == "paged":
            assert choice.self_check is not None and choice.self_check.startswith("passed")
            assert max(server.batch_sizes) > 1  # steps of different requests shared forwards
