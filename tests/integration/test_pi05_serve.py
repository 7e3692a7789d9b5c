"""pi0.5 served on real worker processes: ``serve("tiny-pi05")`` on one rank, and with the
PaliGemma prefix encoder and the action expert on two ranks
(``walkserve/adapters/pi05/placements/pi05.2ranks.yaml``).

Eight concurrent ``act`` requests with different images, prompts (of different lengths, one
padded) and states, each with its own noise: the served actions equal the eager policy's
(``Pi05Policy.sample_actions``, same noise, one request at a time) within 1e-5 of
max|actions|, since the served expert runs the eight requests as one batched call per step
(``walkserve.testing`` says why batching is not bitwise). One request goes through
``POST /v1/walks/act`` of the HTTP app with base64 tensors (on each server: the route is
the same, the placement is not). The server fixture is
parametrized by placement at module scope: each server starts once for all its tests.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from walkserve.adapters import pi05
from walkserve.adapters.registry import capture_model
from walkserve.api import jsontensor
from walkserve.api.app import create_app
from walkserve.api.profile import ModelProfile
from walkserve.capture.model import CapturedModel
from walkserve.runtime.server import RequestFailed, Server, serve
from walkserve.testing import assert_outputs_match

NAME = "tiny-pi05"
TWO_RANKS = "walkserve/adapters/pi05/placements/pi05.2ranks.yaml"
CONCURRENT = 8


@pytest.fixture(scope="module")
def captured() -> CapturedModel:
    return capture_model(NAME)


@pytest.fixture(scope="module", params=[None, TWO_RANKS], ids=["1rank", "2ranks"])
def server(request: pytest.FixtureRequest, captured: CapturedModel) -> Iterator[Server]:
    with serve(captured, request.param) as s:
        yield s


def one_rank(server: Server) -> bool:
    return len(server.plan.ranks) == 1


def requests(policy: pi05.Pi05Policy) -> list[dict[str, Any]]:
    """Prompts of 1 to 12 tokens (the budget), each request its own seed."""
    lengths = [1, 12, 5, 9, 3, 12, 7, 11]
    return [
        pi05.sample_inputs(policy, batch=1, prompt_len=n, seed=100 + i)
        for i, n in enumerate(lengths)
    ]


def eager(policy: pi05.Pi05Policy, r: dict[str, Any]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"actions": policy.sample_actions(**r)}


def test_concurrent_requests_equal_the_eager_policy(
    server: Server, captured: CapturedModel
) -> None:
    policy = captured.model
    assert isinstance(policy, pi05.Pi05Policy)
    reqs = requests(policy)
    futures = [server.submit_future(r, "act") for r in reqs]  # admitted in one round
    handles = [f.result() for f in futures]
    outputs = [h.result(timeout=120) for h in handles]
    for got, r in zip(outputs, reqs, strict=True):
        assert set(got) == {"actions"}  # the prefix's keys and values are request state
        assert_outputs_match(got, eager(policy, r))
    first = outputs[0]["actions"]
    assert all((o["actions"] - first).abs().max() > 0.1 for o in outputs[1:])
    # Alone, each request costs 12 dispatches (pad_prompt, prefix, 10 expert steps); the eight
    # are admitted in one or (racing the conductor loop) a few rounds and then share them.
    dispatches = sum(server.batch_sizes.values())
    assert max(server.batch_sizes) > 1 and dispatches <= 12 * CONCURRENT // 2, server.batch_sizes
    stats = server.stats()
    assert stats.live_requests == 0 and stats.live_values == 0
    ranks = {n.target: n.ranks for w in server.plan.walks for n in server.plan.nodes(w)}
    want = {"prefix": [0], "expert": [0] if one_rank(server) else [1]}
    assert {k: ranks[k] for k in want} == want


def test_a_bad_request_fails_alone(server: Server, captured: CapturedModel) -> None:
    policy = captured.model
    r = requests(policy)[2]
    too_long = {**r, "prompt_ids": torch.ones(1, 13, dtype=torch.long)}
    bad = server.submit(too_long, "act")
    good = server.submit(r, "act")
    with pytest.raises(RequestFailed, match="L <= 12"):
        bad.result(timeout=120)
    assert_outputs_match(good.result(timeout=120), eager(policy, r))


def b64(t: torch.Tensor) -> dict[str, Any]:
    data = base64.b64encode(t.contiguous().numpy().tobytes()).decode()
    return {"b64": data, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def test_act_over_http(server: Server, captured: CapturedModel) -> None:
    policy = captured.model
    r = requests(policy)[5 if one_rank(server) else 6]
    client = TestClient(create_app(server, ModelProfile(NAME)))
    body = {"inputs": {k: b64(v) for k, v in r.items()}, "encoding": "b64"}
    resp = client.post("/v1/walks/act", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()["outputs"]
    assert set(out) == {"actions"}
    got = {"actions": jsontensor.tensor_from_json("actions", out["actions"], None)}
    assert_outputs_match(got, eager(policy, r))
    missing = {"inputs": {k: v for k, v in body["inputs"].items() if k != "noise"}}
    resp = client.post("/v1/walks/act", json=missing)
    assert resp.status_code == 400 and "noise" in resp.json()["error"]["message"]
