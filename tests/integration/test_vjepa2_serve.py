"""V-JEPA 2-AC served on real worker processes: ``serve("walkserve.adapters.vjepa2_ac:tiny")``.

Concurrent rollouts of mixed horizons (cached and native walks) equal the reference
interpreter run per request (``walkserve.testing.assert_outputs_match``: floats within 1e-5
of max|reference|, since served predictor calls are batched across requests), and one
rollout through the HTTP route ``POST /v1/walks/rollout`` (the app of ``walkserve serve`` on
a uvicorn thread over the same server, a real socket on 127.0.0.1) equals the reference too.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from walkserve.adapters import vjepa2_ac as ac
from walkserve.adapters.registry import capture_model
from walkserve.api import jsontensor
from walkserve.api.app import ApiConfig, create_app
from walkserve.api.profile import ModelProfile
from walkserve.capture.model import CapturedModel
from walkserve.runtime.server import RequestFailed, Server, serve
from walkserve.testing import assert_outputs_match

NAME = "walkserve.adapters.vjepa2_ac:tiny"
HORIZONS = [2, 7, 4, 9, 3, 6]


@pytest.fixture(scope="module")
def captured() -> CapturedModel:
    return capture_model(NAME)


@pytest.fixture(scope="module")
def server(captured: CapturedModel) -> Iterator[Server]:
    with serve(captured) as s:
        yield s


def requests() -> list[dict[str, Any]]:
    model = ac.tiny()[0]
    return [
        ac.sample_inputs(model, batch=1, context=2 + i % 2, horizon=h, seed=i)
        for i, h in enumerate(HORIZONS)
    ]


def test_concurrent_rollouts_of_mixed_horizons(server: Server, captured: CapturedModel) -> None:
    reqs = requests()
    jobs = [(r, walk) for r in reqs for walk in ("rollout", "rollout_native")]
    handles = [server.submit(r, walk) for r, walk in jobs]  # all in flight at once
    for handle, (r, walk) in zip(handles, jobs):
        got = handle.result(timeout=120)
        assert got["predicted"].shape[1] == r["horizon"]
        assert_outputs_match(got, captured.run(r, walk=walk))
    assert max(server.batch_sizes) > 1, server.batch_sizes  # rollouts shared predictor calls
    stats = server.stats()
    assert stats.live_requests == 0 and stats.live_values == 0


def test_too_few_actions_fail_the_request_only(server: Server, captured: CapturedModel) -> None:
    r = requests()[0]
    short = {**r, "horizon": r["actions"].shape[1] + 1}  # one action short
    with pytest.raises(RequestFailed, match="out of range"):
        server.run(short, "rollout", timeout=120)
    assert_outputs_match(server.run(r, "rollout", timeout=120), captured.run(r, walk="rollout"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rollout_over_http(
    server: Server, captured: CapturedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    streams: list[bool] = []  # each submission's ``stream``
    submit = server.submit_async

    async def recording(inputs: Any, walk: Any = None, request_id: Any = None, stream: bool = True):  # type: ignore[no-untyped-def]
        streams.append(stream)
        return await submit(inputs, walk, request_id, stream)

    monkeypatch.setattr(server, "submit_async", recording)
    app = create_app(server, ModelProfile(NAME), ApiConfig())
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        r = requests()[3]
        body = {
            "inputs": {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in r.items()},
            "encoding": "b64",
        }
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/walks/rollout", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()["outputs"]
        got = {k: jsontensor.tensor_from_json(k, v, None) for k, v in out.items()}
        assert_outputs_match(got, captured.run(r, walk="rollout"))
        # a non-streamed answer reads no stream items: its rank is asked for none
        assert streams == [False]
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/walks/rollout", json={**body, "stream": True}
        ) as s:
            assert s.status_code == 200 and s.read().endswith(b"data: [DONE]\n\n")
        assert streams == [False, True]
        bad = {"inputs": {**body["inputs"], "horizon": "8"}}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/walks/rollout", json=bad, timeout=30)
        assert resp.status_code == 400 and "horizon" in resp.json()["error"]["message"]
    finally:
        http.should_exit = True
        thread.join(timeout=10)
