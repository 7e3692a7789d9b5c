"""Janus image generation served on a real worker process: concurrent requests with different
seeds and prompt lengths equal the reference interpreter (image tokens identical, pixels within
``walkserve.testing``'s tolerance), share batched steps, and leave the worker's KV pool empty."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from walkserve.adapters import janus
from walkserve.adapters.registry import capture_model
from walkserve.runtime.server import serve
from walkserve.testing import assert_outputs_match

FACTORY = "walkserve.adapters.janus:tiny"


def requests() -> list[dict[str, torch.Tensor]]:
    prompts = [(40, 50, 60), (70, 80), (90, 91, 92, 93), (7, 8, 9)]
    return [
        {k: v for k, v in janus.sample_inputs(p).items() if k != "probe"}
        | {"seed": torch.tensor([s])}
        for p, s in zip(prompts, (11, 22, 33, 44))
    ]


def test_four_concurrent_requests_match_the_interpreter_and_free_their_pages() -> None:
    captured = capture_model(FACTORY)
    reqs = requests()
    with serve(captured) as server:
        handles = [server.submit(r, "generate") for r in reqs]  # all in flight at once
        for handle, r in zip(handles, reqs):
            assert_outputs_match(handle.result(timeout=300), captured.run(r, walk="generate"))
        usage = server.submit({"probe": torch.zeros(1)}, "pool_usage").result(timeout=60)
        assert usage["usage"].tolist() == [[0, 0, 0]]  # pages in use, sequences, requests
        assert max(server.batch_sizes) > 1, server.batch_sizes  # steps shared a forward
    assert captured.model.kv.pool.pages_in_use == 0  # the interpreter's pool too
