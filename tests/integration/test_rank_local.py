"""Rank-local execution with real worker processes: a value made on one rank and read on
another travels between them directly (the server process handles its handle, not its
bytes); region runs on a rank free what they hold when a request ends, is cancelled, fails,
or their worker is killed; stats count speculation and values where they happen."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
import torch
from waiting import settled, wait_for

from walkserve.adapters.registry import capture_model
from walkserve.lowering.placement import Placement
from walkserve.runtime.config import PoolConfig, SupervisionConfig
from walkserve.runtime.handle import RequestHandle
from walkserve.runtime.server import RequestFailed, Server, serve
from walkserve.testing import assert_outputs_match

MODEL = "rank_local_models:two_stage"
MIB = 1 << 20


def test_a_value_between_two_ranks_never_passes_through_the_server() -> None:
    captured = capture_model(MODEL)
    placement = Placement.from_dict(
        {"ranks": 2, "nodes": {"widen": [0], "step": [0], "reduce": [1]}}
    )
    with serve(captured, placement) as server:
        transport = server.pool._transport
        for walk in ("direct", "looped"):
            inputs = {"x": torch.randn(1, 4), "steps": 3}
            before = (transport.bytes_in, transport.bytes_out)
            got = server.run(inputs, walk, timeout=120)
            assert_outputs_match(got, captured.run(inputs, walk))
            # The 1 MiB value went rank 0 -> rank 1; the server saw inputs and the result.
            moved = transport.bytes_in - before[0] + transport.bytes_out - before[1]
            assert moved < 4096, (walk, moved)
            assert wait_for(lambda: settled(server)), server.stats()
        stats = server.stats()
        assert stats.ranks[0].objects == 0 and stats.ranks[1].objects == 0


def test_a_failure_mid_region_fails_its_request_and_frees_the_run() -> None:
    captured = capture_model("rank_local_models:long")
    with serve(captured) as server:
        ok = {"h": torch.randn(1, 8), "steps": 50, "fail_at": -1}
        bad = dict(ok, fail_at=20)
        handles = [server.submit(bad, "spin"), server.submit(ok, "spin")]
        with pytest.raises(RequestFailed, match="step 20 of this request fails"):
            handles[0].result(timeout=120)
        assert_outputs_match(handles[1].result(timeout=120), captured.run(ok, "spin"))
        assert wait_for(lambda: settled(server)), server.stats()
        assert server.stats().ranks[0].runs == 0


def test_cancel_mid_region_frees_the_rank_and_its_kv_pages() -> None:
    pytest.importorskip("transformers")
    from walkserve.adapters.hf_causal_lm import sample_request

    captured = capture_model("tiny-llama")
    with serve(captured) as server:
        long_request = dict(sample_request(list(range(3, 40)), 100_000))
        handle = server.submit(long_request)
        stream = handle.stream(timeout=120)
        for _ in range(5):  # the decode region is running on the rank
            next(stream)
        assert server.stats().ranks[0].runs == 1
        handle.cancel()
        with pytest.raises(RequestFailed, match="cancelled"):
            handle.result(timeout=60)
        assert wait_for(lambda: settled(server)), server.stats()
        assert server.stats().ranks[0].runs == 0
        assert wait_for(lambda: all(k.pages_in_use == 0 for k in server.kv_stats()[0]))
        short = sample_request([5, 6, 7], 4)
        assert_outputs_match(server.run(short, timeout=120), captured.run(short))


def test_a_lone_cohort_takes_the_fast_lane_and_a_cancel_still_stops_it() -> None:
    captured = capture_model("rank_local_models:drift")
    with serve(captured) as server:
        short = {"h": torch.randn(1, 4, 8), "steps": 40}
        assert_outputs_match(server.run(short, "drift", timeout=120), captured.run(short, "drift"))
        counters = server.stats().ranks[0].counters
        lane = counters["loop_stepper/lane_steps"]
        assert 0 < lane <= 40  # its steps, the first too (a command can end the lane early)
        # the rank froze its heap once set up (``runtime.heap``): torch, the model and the
        # plan are out of the cyclic collector's sight, not walked by each full collection
        assert counters["gc/frozen_objects"] > 50_000
        assert "gc/full_collections" in counters
        endless = {"h": torch.randn(1, 4, 8), "steps": 10_000_000}
        handle = server.submit(endless, "drift", stream=False)
        assert wait_for(lambda: server.stats().ranks[0].counters["loop_stepper/lane_steps"] > lane)
        handle.cancel()
        with pytest.raises(RequestFailed, match="cancelled"):
            handle.result(timeout=60)
        assert wait_for(lambda: settled(server)), server.stats()
        assert server.stats().ranks[0].runs == 0
        assert_outputs_match(server.run(short, "drift", timeout=120), captured.run(short, "drift"))


def test_a_streamed_loop_reaches_its_async_client_item_by_item_with_few_wakes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lone loop whose client streams every step's state: the client gets each item, in
    order, and they join to the final output; the rank reports them coalesced, and a pass
    wakes the client's event loop once for all the items it routes, not once per item."""
    captured = capture_model("rank_local_models:trail")
    wakes = 0
    notify = RequestHandle._notify

    def counted(self: RequestHandle) -> None:
        nonlocal wakes
        wakes += 1
        notify(self)

    monkeypatch.setattr(RequestHandle, "_notify", counted)
    r = {"h": torch.randn(1, 8), "steps": 60}

    async def client(server: Server) -> tuple[list[Any], dict[str, Any]]:
        handle = await server.submit_async(r, "trail", stream=True)
        items = [item async for item in handle.astream()]
        return items, await handle.aresult()

    with serve(captured) as server:
        items, out = asyncio.run(client(server))
    assert [i.index for i in items] == list(range(60))
    assert torch.equal(torch.stack([i.value for i in items], dim=1), out["states"])
    assert_outputs_match(out, captured.run(r, "trail"))
    assert wakes < 60 // 2, wakes  # one a pass (its items come coalesced), and the end's


def test_region_runs_that_arrive_together_step_together_from_their_first_step() -> None:
    captured = capture_model("rank_local_models:drift")
    with serve(captured) as server:
        requests = [{"h": torch.randn(1, 4, 8), "steps": 40} for _ in range(8)]
        with server._passes.lock:  # no pass until all eight wait: one pass admits them all
            futures = [server.submit_future(r, "drift", stream=False) for r in requests]
        server.pool.nudge()  # the io thread makes that pass: one StartRegions of 8 runs
        for r, f in zip(requests, futures):
            got = f.result(timeout=120).result(timeout=120)
            assert_outputs_match(got, captured.run(r, "drift"))
        # the rank took the eight starts in one pass: every step held all eight rows (had it
        # stepped the first run alone while reading the others, a step of 1 would show)
        assert set(server.batch_sizes) == {8}, server.batch_sizes


def test_a_killed_rank_fails_its_region_runs_and_the_other_rank_serves_on() -> None:
    captured = capture_model(MODEL)
    # ``looped`` wholly on rank 1 (one region), ``direct`` wholly on rank 0.
    nodes = {f"looped:{n}": [1] for n in ("widen", "cycle/step", "reduce")}
    nodes |= {f"direct:{n}": [0] for n in ("widen", "reduce")}
    placement = Placement.from_dict({"ranks": 2, "nodes": nodes})
    no_restart = PoolConfig(supervision=SupervisionConfig(restart=False))  # test_restart's
    with serve(captured, placement, pool_config=no_restart) as server:
        handle = server.submit({"x": torch.randn(1, 4), "steps": 1_000_000}, "looped")
        assert wait_for(
            lambda: server.stats().ranks.get(1) is not None and server.stats().ranks[1].runs == 1
        )
        pid = server.pool.pid(1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="rank 1"):
            handle.result(timeout=60)
        assert wait_for(lambda: server.health()[1].status == "dead")
        inputs = {"x": torch.randn(1, 4)}
        assert_outputs_match(
            server.run(inputs, "direct", timeout=120), captured.run(inputs, "direct")
        )
        assert wait_for(lambda: settled(server)), server.stats()


def test_a_rank_that_slept_is_woken_while_a_request_is_admitted() -> None:
    """``WorkerPool.wake``: a request that finds a rank idle for longer than its idle spin
    sends it ``Wake`` first, so that it wakes while the request is admitted, then the work; a
    rank still spinning gets none, and neither does one that never spins (it would sleep again
    at once)."""
    import msgspec

    from walkserve.runtime.messages import decode

    captured = capture_model("rank_local_models:long")
    with serve(captured, pool_config=PoolConfig(idle_spin_s=0.005)) as server:
        pool = server.pool
        sent: list[str] = []
        send = pool._send

        def spy(state: object, data: bytes, **kw: bool) -> None:
            sent.append(type(decode(data)).__name__)
            send(state, data, **kw)  # type: ignore[arg-type]

        pool._send = spy  # type: ignore[method-assign]

        def served(busy_at: float) -> list[str]:
            for state in pool._ranks.values():
                state.busy_at = busy_at
            sent.clear()
            inputs = {"h": torch.randn(1, 8), "steps": 5, "fail_at": -1}
            assert_outputs_match(
                server.run(inputs, "spin", timeout=120), captured.run(inputs, "spin")
            )
            return list(sent)

        assert served(0.0)[:2] == ["Wake", "StartRegions"]  # idle since long ago
        assert "Wake" not in served(float("inf"))  # busy a moment ago: still spinning
        # quiet for long, but in the middle of a loop (a lane reports at its end): busy
        long = server.submit({"h": torch.randn(1, 8), "steps": 10**6, "fail_at": -1}, "spin")
        assert wait_for(lambda: server.stats().ranks[0].runs == 1, timeout=60)
        assert "Wake" not in served(0.0)
        long.cancel()
        with pytest.raises(RequestFailed, match="cancelled"):
            long.result(timeout=60)
        pool._worker_config = msgspec.structs.replace(pool._worker_config, idle_spin_s=0.0)
        assert "Wake" not in served(0.0)
        assert wait_for(lambda: settled(server)), server.stats()
