"""Supervision of the server's conductor loop and of its shared memory, with real workers.

- An exception inside the conductor loop fails the requests it holds (logged with its
  traceback) and the loop goes on: later requests are served and correct. Failing again and
  again within a short window stops it: ``Server.fatal`` says why and new requests are refused.
- A full shared-memory pool (a worker stalled while inputs pile up) slows messages, never
  wedges the server: tensors go inline, every request is answered once the worker resumes.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from walkserve.adapters.registry import capture_model
from walkserve.runtime.config import PoolConfig, ShmPoolConfig
from walkserve.runtime.server import RequestFailed, serve
from walkserve.testing import assert_outputs_match


def test_an_exception_in_the_conductor_loop_fails_its_requests_and_the_loop_goes_on() -> None:
    captured = capture_model("example-text")
    sample = captured.sample_inputs
    with serve(captured) as server:
        real = server.conductor.ready
        calls = {"n": 0}

        def ready_once_broken() -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected fault")
            return real()

        server.conductor.ready = ready_once_broken  # type: ignore[method-assign]
        with pytest.raises(RequestFailed, match="injected fault"):
            server.run(sample, timeout=60)
        assert server.fatal is None
        assert_outputs_match(server.run(sample, timeout=60), captured.run(sample))
        # Failing every time: after a few faults the loop stops and says why.
        server.conductor.ready = lambda: (_ for _ in ()).throw(RuntimeError("always"))  # type: ignore[method-assign]
        for _ in range(3):
            with pytest.raises(RequestFailed):
                server.run(sample, timeout=60)
            if server.fatal is not None:
                break
        deadline = time.monotonic() + 10
        while server.fatal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.fatal is not None and "always" in server.fatal
        with pytest.raises(RuntimeError, match="the server stopped"):
            server.submit(sample)


def test_a_full_shared_memory_pool_never_wedges_the_server() -> None:
    captured = capture_model("rank_local_models:two_stage")
    pool = PoolConfig(shm=ShmPoolConfig(slots_per_class=1, when_exhausted="raise"))
    inputs = [{"big": torch.randn(1, 4, 1 << 16)} for _ in range(6)]  # 1 MiB each
    with serve(captured, pool_config=pool) as server:
        pid = server.pool.pid(0)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # nothing is read or acked: the one slot stays held
        try:
            handles = [server.submit(r, "mean") for r in inputs]
            deadline = time.monotonic() + 30  # all sent: one through the pool, the rest inline
            while server.pool._transport.exhausted < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            os.kill(pid, signal.SIGCONT)
        for handle, r in zip(handles, inputs):
            assert_outputs_match(handle.result(timeout=120), captured.run(r, "mean"))
        assert server.pool._transport.exhausted >= 4
        assert server.health()[0].status == "ready"
