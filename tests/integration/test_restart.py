"""Supervision of the worker ranks with real processes (``runtime.supervisor``, ``pool``).

- SIGKILL of a worker mid-request: the request fails naming the rank, the rank is started
  again (same weights and plan, a fresh output pool: the old one's segments are gone), the
  next request is served and correct; values another rank held for the failed request are
  released.
- SIGSTOP past the hang deadline: the request in flight fails within the deadline (plus a
  margin), the rank is killed and replaced; SIGCONT of the old process and messages sent
  under the old incarnation's identity do not disturb the new one.
- A crash loop (here: no restart allowed) ends in ``failed``: later work fails at once.
- ``Server.drain``: new requests refused, the admitted ones given the grace period; what is
  left when it ends fails as the server closes (``walkserve serve`` on SIGTERM:
  ``tests/e2e/test_drain.py``).

After each: 0 live values, shared memory idle. Bound on a restart, stated: back within
``RESTART_BOUND_S`` (a worker start: spawn, import torch, load the weights; about 2 s here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import pytest
import torch
import zmq
from waiting import settled, wait_for

from walkserve.adapters.registry import capture_model
from walkserve.lowering.placement import Placement
from walkserve.runtime.config import PoolConfig, SupervisionConfig, routing_id
from walkserve.runtime.messages import BatchDone, Heartbeat, encode
from walkserve.runtime.server import RequestFailed, Server, serve
from walkserve.testing import assert_outputs_match

MODEL = "rank_local_models:two_stage"
RESTART_BOUND_S = 20.0  # generous: the CI machine is shared
DEADLINE_S = 1.5


def back(server: Server, rank: int, restarts: int) -> bool:
    h = server.health()[rank]
    return h.status == "ready" and h.restarts == restarts


def segments(pool_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"wsp_{pool_id}_")]


@pytest.fixture(scope="module")
def server() -> Server:
    captured = capture_model(MODEL)
    # ``looped``: the large value made on rank 0 (held there), the loop and the reduction
    # on rank 1. ``direct`` wholly on rank 0.
    nodes = {"looped:widen": [0], "looped:cycle/step": [1], "looped:reduce": [1]}
    nodes |= {f"direct:{n}": [0] for n in ("widen", "reduce")}
    placement = Placement.from_dict({"ranks": 2, "nodes": nodes})
    config = PoolConfig(heartbeat_s=0.2, supervision=SupervisionConfig(hang_deadline_s=DEADLINE_S))
    with serve(captured, placement, pool_config=config) as server:
        yield server


def run_looped(server: Server, steps: int = 3) -> None:
    inputs = {"x": torch.randn(1, 4), "steps": steps}
    expected = server.captured.run(inputs, "looped")
    assert_outputs_match(server.run(inputs, "looped", timeout=60), expected)


def start_long(server: Server) -> tuple[object, int]:
    """A looped request that keeps rank 1 busy (its region runs there)."""
    handle = server.submit({"x": torch.randn(1, 4), "steps": 1_000_000}, "looped")
    assert wait_for(lambda: (r := server.stats().ranks.get(1)) is not None and r.runs == 1), (
        server.stats()
    )
    pid = server.pool.pid(1)
    assert pid is not None
    return handle, pid


def test_sigkill_mid_request_fails_it_and_the_rank_comes_back(server: Server) -> None:
    restarts = server.health()[1].restarts
    old_pool = server.health()[1].shm_pool
    assert old_pool is not None
    handle, pid = start_long(server)
    assert server.stats().ranks[0].objects >= 1  # rank 0 holds the value rank 1 loops over
    old_link = server.pool._ranks[1].link
    assert old_link is not None  # a rank this process spawned talks over its rank link
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RequestFailed, match=r"worker rank 1 \(pid \d+\) died \(killed by SIGKILL"):
        handle.result(timeout=30)  # type: ignore[attr-defined]
    assert wait_for(lambda: back(server, 1, restarts + 1), RESTART_BOUND_S), server.health()
    print(f"rank 1 back {time.monotonic() - t0:.2f} s after SIGKILL")
    assert server.pool.pid(1) != pid and server.health()[1].shm_pool != old_pool
    assert segments(old_pool) == []
    new_link = server.pool._ranks[1].link  # the new process's link; the dead one's is closed
    assert new_link is not None and new_link is not old_link and old_link.closed
    assert len(server.pool._links) == 2
    run_looped(server)
    assert wait_for(lambda: settled(server)), server.stats()  # rank 0 released its value too


def test_a_stopped_rank_past_its_deadline_is_killed_and_replaced(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    restarts = server.health()[1].restarts
    handle, pid = start_long(server)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(
            RequestFailed, match=r"rank 1 .*sent nothing for .* s \(deadline 1.5 s\)"
        ):
            handle.result(timeout=30)  # type: ignore[attr-defined]
        failed_after = time.monotonic() - t0
        assert failed_after < DEADLINE_S + 2.0, failed_after
        # Work sent while it restarts waits for it (the Python API; HTTP answers 503).
        waiting = server.submit({"x": torch.randn(1, 4), "steps": 2}, "looped")
        assert wait_for(lambda: back(server, 1, restarts + 1), RESTART_BOUND_S), server.health()
        print(f"failed {failed_after:.2f} s after SIGSTOP, back {time.monotonic() - t0:.2f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    waiting.result(timeout=60)
    # Whatever the old incarnation might still say is not heard: its identity is forgotten.
    ctx = zmq.Context.instance()
    stale = ctx.socket(zmq.DEALER)
    stale.setsockopt(zmq.ROUTING_ID, routing_id(1, server.health()[1].restarts - 1))
    stale.setsockopt(zmq.LINGER, 0)
    stale.connect(server.pool.address)
    try:
        stale.send(encode(Heartbeat(1, 0.0, [])))
        stale.send(encode(BatchDone(0, 1, [], [], [])))
        with caplog.at_level(logging.WARNING, "walkserve.pool"):
            run_looped(server)
            assert wait_for(lambda: caplog.text.count("unknown peer") >= 2), caplog.text
        assert server.health()[1].status == "ready"
    finally:
        stale.close()
    assert wait_for(lambda: settled(server)), server.stats()


def test_a_crash_loop_ends_in_failed_and_work_for_it_fails_at_once() -> None:
    captured = capture_model(MODEL)
    config = PoolConfig(supervision=SupervisionConfig(max_restarts=0))
    with serve(captured, pool_config=config) as server:
        pid = server.pool.pid(0)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: server.health()[0].status == "failed"), server.health()
        assert "not restarting it again" in (server.health()[0].error or "")
        reason = server.unavailable()
        assert reason is not None and "worker rank 0 failed" in reason
        t0 = time.monotonic()
        with pytest.raises(RequestFailed, match="rank 0"):
            server.run({"x": torch.randn(1, 4)}, "direct", timeout=10)
        assert time.monotonic() - t0 < 5
        assert wait_for(lambda: settled(server)), server.stats()


def test_drain_refuses_new_requests_and_waits_for_the_admitted_ones_within_its_grace() -> None:
    captured = capture_model(MODEL)
    with serve(captured) as server:
        short = server.submit({"x": torch.randn(1, 4), "steps": 2}, "looped")
        long = server.submit({"x": torch.randn(1, 4), "steps": 1_000_000}, "looped")
        t0 = time.monotonic()
        assert not server.drain(grace_s=1.0)  # the long one cannot finish in time
        assert 1.0 <= time.monotonic() - t0 < 3.0
        short.result(timeout=0)  # finished within the grace
        assert server.unavailable() == "the server is shutting down"
        with pytest.raises(RuntimeError, match="shutting down"):
            server.submit({"x": torch.randn(1, 4), "steps": 2}, "looped")
    with pytest.raises(RequestFailed, match="the server closed"):
        long.result(timeout=10)
