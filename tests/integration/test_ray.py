"""The Ray backend: ``serve(..., launch=LaunchConfig(backend="ray"))`` starts a local Ray cluster (``ray.init()``)
and runs each rank as a Ray actor; the actors join the conductor over CURVE-encrypted TCP and,
being on this host, exchange tensors through shared memory (not Ray's object store). The CFG
branches on two rank actors give the reference interpreter's outputs. Skipped when ray is not
installed (it is an optional extra)."""

from __future__ import annotations

import pytest

from walkserve import capture
from walkserve.adapters.examples import example_placement
from walkserve.adapters.registry import load_model
from walkserve.runtime.config import LaunchConfig
from walkserve.runtime.net.ray_backend import ray_available
from walkserve.runtime.server import serve
from walkserve.testing import assert_outputs_match, mixed_requests

OK, WHY = ray_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"ray is not installed ({WHY}): pip install ray")


def test_cfg_branches_on_two_ray_actors() -> None:
    name = "example-cfg-image"
    model, sample = load_model(name)
    captured = capture.trace(model, sample)
    reqs = mixed_requests(name, sample, 4)
    with serve(name, example_placement(name, 2), launch=LaunchConfig(backend="ray")) as server:
        assert server.pool.config.remote_ranks == (0, 1)
        assert {server.pool.remote_data(r) for r in (0, 1)} == {"shm"}  # same host
        for walk in captured.graph.entry_walks():
            handles = [server.submit(r, walk) for r in reqs]
            for handle, r in zip(handles, reqs):
                assert_outputs_match(handle.result(timeout=120), captured.run(r, walk))
        assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}
        launcher = server.closers[0].__self__  # type: ignore[attr-defined]
    assert launcher.last_exit_codes == {0: 0, 1: 0}  # Worker.run returned cleanly
