"""The runtime end to end: ``serve()`` starts real worker processes; 16 concurrent requests
of mixed sizes per example walk, on 1 rank and on 2 ranks (CFG branches split; speech thinker
on rank 0, talker + codec on rank 1), against the reference interpreter per request.

Outputs are compared by ``walkserve.testing.assert_outputs_match``: integers identical, floats
within 1e-5 of max|reference| (the served components run batched; the module says why)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters.examples import EXAMPLES, example_placement
from walkserve.adapters.registry import load_model
from walkserve.lowering.placement import Placement
from walkserve.runtime.config import PoolConfig, SchedulingConfig, SupervisionConfig
from walkserve.runtime.server import RequestFailed, Server, serve
from walkserve.testing import assert_outputs_match, mixed_requests

CAPTURED: dict[str, tuple[capture.CapturedModel, dict[str, Any]]] = {}


def reference(name: str) -> tuple[capture.CapturedModel, dict[str, Any]]:
    if name not in CAPTURED:
        model, sample = load_model(name)
        CAPTURED[name] = (capture.trace(model, sample), sample)
    return CAPTURED[name]


def run_all(server: Server, name: str) -> None:
    captured, sample = reference(name)
    reqs = mixed_requests(name, sample, 16)
    for walk in captured.graph.entry_walks():
        handles = [server.submit(r, walk) for r in reqs]  # all in flight at once
        for handle, r in zip(handles, reqs):
            assert_outputs_match(handle.result(timeout=300), captured.run(r, walk))
    stats = server.stats()
    assert stats.live_requests == 0 and stats.live_values == 0
    assert server.pool.shm_stats().in_use == 0


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_on_one_rank(name: str) -> None:
    with serve(name) as server:
        run_all(server, name)
        # Continuous batching: requests of different lengths shared component calls.
        assert max(server.batch_sizes) > 1, server.batch_sizes


@pytest.mark.parametrize("name", ["example-cfg-image", "example-speech"])
def test_two_ranks(name: str) -> None:
    with serve(name, example_placement(name, 2)) as server:
        run_all(server, name)
        assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}


def test_streamed_items_join_to_the_final_output() -> None:
    _, sample = reference("example-speech")
    with serve("example-speech", example_placement("example-speech", 2)) as server:
        handle = server.submit({**sample, "max_new_tokens": 12})
        items = list(handle.stream(timeout=120))
        out = handle.result(timeout=120)
        waveform = [i.value for i in items if i.channel == "waveform"]
        assert len(waveform) > 1 and torch.equal(torch.cat(waveform, dim=-1), out["waveform"])
        codes = [i.index for i in items if i.channel == "codes"]
        assert codes == sorted(codes)


def test_speculation_off_wastes_nothing() -> None:
    _, sample = reference("example-text")
    with serve("example-text", scheduling=SchedulingConfig(speculate=False)) as server:
        for r in mixed_requests("example-text", sample, 6):
            server.run(r, timeout=120)
        stats = server.stats()
        assert stats.speculated_steps == 0 and stats.wasted_steps == 0
    with serve("example-text") as server:
        terminations = 0
        for r in mixed_requests("example-text", sample, 6):
            server.run(r, timeout=120)
            terminations += 1
        stats = server.stats()
        assert stats.wasted_steps <= terminations


def test_cancel_mid_walk_releases_state() -> None:
    captured, sample = reference("example-cfg-image")
    with serve("example-cfg-image") as server:
        # A walk runs inside its rank now (tens of ms): cancel a crowd of them while the rank
        # holds their runs, so that some are surely cancelled mid-walk.
        handles = [server.submit(sample, "generate") for _ in range(12)]
        deadline = time.time() + 60
        while not server.stats().ranks[0].runs and time.time() < deadline:
            time.sleep(0.005)
        for handle in handles:
            handle.cancel()
        cancelled = 0
        for handle in handles:
            try:
                assert_outputs_match(handle.result(timeout=60), captured.run(sample, "generate"))
            except RequestFailed as e:
                assert "cancelled" in str(e)
                cancelled += 1
        assert cancelled > 0
        deadline = time.time() + 30
        while server.stats().live_requests and time.time() < deadline:
            time.sleep(0.05)
        assert server.stats().live_values == 0 and server.stats().ranks[0].runs == 0
        # The next request is answered, and correct.
        assert_outputs_match(
            server.run(sample, "generate", timeout=120), captured.run(sample, "generate")
        )
        deadline = time.time() + 30
        while server.pool.shm_stats().in_use and time.time() < deadline:
            time.sleep(0.05)
        assert server.pool.shm_stats().in_use == 0


def test_killed_worker_fails_its_requests_and_others_go_on() -> None:
    captured, sample = reference("example-cfg-image")
    # Everything on rank 0 except the edit walk's image encoder.
    placement = Placement.from_dict({"ranks": 2, "nodes": {"edit:image_encoder": [1]}})
    no_restart = PoolConfig(supervision=SupervisionConfig(restart=False))  # test_restart's
    with serve("example-cfg-image", placement, pool_config=no_restart) as server:
        pid = server.pool.pid(1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 30
        while server.health()[1].status != "dead" and time.time() < deadline:
            time.sleep(0.05)
        assert server.health()[1].status == "dead"
        with pytest.raises(RequestFailed, match="rank 1"):
            server.run(sample, "edit", timeout=120)
        assert_outputs_match(
            server.run(sample, "generate", timeout=120), captured.run(sample, "generate")
        )


def test_hugging_face_lm_served_from_a_captured_model() -> None:
    pytest.importorskip("transformers")
    from walkserve.adapters.hf_causal_lm import sample_request
    from walkserve.adapters.registry import capture_model

    captured = capture_model("tiny-llama")
    g = torch.Generator().manual_seed(3)
    reqs = [
        {
            **sample_request([], 1 + 3 * i),
            "input_ids": torch.randint(3, 256, (1, 2 + 3 * i), generator=g),
            "temperature": 0.0 if i % 2 else 0.8,
            "seed": i,
        }
        for i in range(4)
    ]
    # The paged KV cache never leaves the worker (an ObjectRef travels instead); decode is
    # skipped by the model's own transition when max_new_tokens is 1.
    with serve(captured) as server:
        handles = [server.submit(r) for r in reqs]
        for handle, r in zip(handles, reqs):
            assert_outputs_match(handle.result(timeout=120), captured.run(r))


def test_a_captured_model_without_origin_is_refused() -> None:
    model, sample = load_model("example-text")
    with pytest.raises(ValueError, match="capture_model"):
        serve(capture.trace(model, sample))
