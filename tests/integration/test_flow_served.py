"""The newcomer's flow sampler (``walkserve.adapters.examples.flow``: ``range(points - 1)``
over an int walk input, ``torch.linspace(1, 0, points)``, noise from a ``torch.Generator``
seeded inside the walk) served on worker processes through ``runtime.server.serve``, on one
rank and on two:
concurrent requests of different step counts, seeds and batch sizes equal the eager method
(``walkserve.testing.assert_outputs_match``: within 1e-5 of max|eager|, since requests that
share a batched component call are summed in another order), and a bad step count is
refused before admission with an error naming the input and the rule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from walkserve.adapters.examples import flow
from walkserve.adapters.registry import capture_model
from walkserve.lowering.placement import Placement
from walkserve.runtime.server import Server, serve
from walkserve.testing import assert_outputs_match

NAME = "walkserve.adapters.examples.flow:build"


@pytest.fixture(scope="module", params=["1rank", "2ranks"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    # On two ranks the Euler loop spans both (its velocity calls on rank 1, the rest on 0),
    # so the conductor drives it and evaluates points - 1 itself; on one, rank 0 runs the
    # whole walk as a region.
    placement = Placement(ranks=2, rules={"velocity": [1]}) if request.param == "2ranks" else None
    with serve(capture_model(NAME), placement) as s:
        yield s


def request(points: int, seed: int, batch: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + seed)
    return {
        "prompt_ids": torch.randint(0, flow.VOCAB, (batch, 3 + seed % 4), generator=g),
        "ref": torch.randn(batch, flow.CHANNELS, flow.SIZE, flow.SIZE, generator=g),
        "points": points,
        "seed": seed,
    }


def test_served_requests_equal_eager(server: Server) -> None:
    model, _ = flow.build()
    reqs = [request(8, 1, 1), request(3, 2, 2), request(12, 3, 1), request(1, 4, 1)]
    reqs.append(dict(request(5, 5, 1), text_guidance=0.5))
    handles = [server.submit(r, "sample") for r in reqs]  # all in flight at once
    for handle, r in zip(handles, reqs):
        got = handle.result(timeout=120)
        with torch.no_grad():
            want = model.sample(**r)
        assert_outputs_match(got, want)


def test_bad_step_count_is_refused_naming_the_input(server: Server) -> None:
    with pytest.raises(ValueError, match=r"input 'points'.*points - 1.*-3.*rule: trip-count"):
        server.submit(request(-2, 1, 1), "sample")
    with pytest.raises(ValueError, match=r"input 'prompt_ids'.*vocabulary.*rule: vocabulary"):
        server.submit(dict(request(4, 1, 1), prompt_ids=torch.tensor([[1, flow.VOCAB]])), "sample")
    with pytest.raises(ValueError, match=r"input 'points'.*rule: trip-count"):  # run() too
        server.run(request(-2, 1, 1), "sample", timeout=120)
    got = server.run(request(4, 6, 1), "sample", timeout=120)  # the server still serves
    with torch.no_grad():
        assert_outputs_match(got, flow.build()[0].sample(**request(4, 6, 1)))
