"""Admission of a burst with a real worker: submissions are admitted together, by the pass
their caller's first wait makes, and reach their rank in chunks of ``ADMIT_CHUNK`` that it steps
as one cohort (``runtime.burst``); a burst no caller waits on is admitted by the io thread
within ``BURST_WAIT_S``, and one whose future gets a callback (``asyncio.wrap_future``) at once.
Every request gets the reference interpreter's outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from waiting import settled, wait_for

from walkserve.adapters.registry import capture_model
from walkserve.runtime import conductorpass, passes
from walkserve.runtime.server import serve
from walkserve.testing import assert_outputs_match


def test_a_burst_is_admitted_in_one_pass_by_its_callers_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the io thread leaves the burst to its caller, however slow this host is
    monkeypatch.setattr(passes, "BURST_WAIT_S", 60.0)
    captured = capture_model("rank_local_models:long")
    reqs = [{"h": torch.randn(1, 8), "steps": 6 + k, "fail_at": -1} for k in range(6)]
    with serve(captured) as server:
        server.run(reqs[0], "spin", timeout=120)  # warm
        assert wait_for(lambda: settled(server)), server.stats()  # the io thread is idle
        starts: list[int] = []  # region starts per message to the rank
        chunks: list[tuple[int, bool]] = []  # and whether more follow
        regions = server.pool.regions
        start = regions.start

        def spy(rank: int, batch: Any, burst: bool = False) -> None:
            batch = list(batch)
            starts.append(len(batch))
            chunks.append((len(batch), burst))
            start(rank, batch, burst)

        monkeypatch.setattr(regions, "start", spy)
        monkeypatch.setattr(conductorpass, "ADMIT_CHUNK", 4)
        before = server.stats()
        sizes = dict(before.ranks[0].batch_sizes)
        futures = [server.submit_future(r, "spin", stream=False) for r in reqs]
        assert starts == []  # all queued, the first too
        handles = [f.result(timeout=120) for f in futures]  # the first wait admits them
        assert chunks == [(4, True), (2, False)]  # one pass, sent as it admitted them
        for r, h in zip(reqs, handles):
            assert_outputs_match(h.result(timeout=120), captured.run(r, "spin"))
        # they stepped as one cohort from their first step (the rank held the first chunk):
        # 6 steps of all six, then one fewer at each step as the shortest ends
        after = server.stats().ranks[0].batch_sizes
        made = {k: v - sizes.get(k, 0) for k, v in after.items() if v != sizes.get(k, 0)}
        assert made == {6: 6, 5: 1, 4: 1, 3: 1, 2: 1, 1: 1}, made
        assert server.stats().counters["burst/holds"] == before.counters["burst/holds"] + 1

        # no caller waits: the io thread admits the burst within BURST_WAIT_S (long enough
        # here that the three are queued before it, however slow this host is)
        monkeypatch.setattr(passes, "BURST_WAIT_S", 0.05)
        assert wait_for(lambda: settled(server)), server.stats()
        starts.clear()
        futures = [server.submit_future(r, "spin", stream=False) for r in reqs[:3]]
        assert wait_for(lambda: all(f.done() for f in futures), timeout=30)
        assert starts == [3]
        # a callback on the future (asyncio.wrap_future's) admits what is queued at once
        monkeypatch.setattr(passes, "BURST_WAIT_S", 60.0)
        assert wait_for(lambda: settled(server)), server.stats()
        starts.clear()
        futures = [server.submit_future(r, "spin", stream=False) for r in reqs[:2]]
        called: list[Any] = []
        futures[1].add_done_callback(called.append)
        assert wait_for(lambda: bool(called), timeout=30)
        assert starts == [2]
        for f in futures:
            f.result(timeout=120).result(timeout=120)
        assert wait_for(lambda: settled(server)), server.stats()


def test_a_pass_sends_the_ranks_releases_before_it_wakes_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The releases of the requests a pass ended leave before any of their callers is woken: a
    caller woken first would take the GIL at the send's syscall and hold up the rest of the
    pass (``ConductorPass._route``). Outputs are still the interpreter's."""
    from walkserve.runtime.handle import RequestHandle

    captured = capture_model("rank_local_models:long")
    reqs = [{"h": torch.randn(1, 8), "steps": 4, "fail_at": -1} for _ in range(4)]
    with serve(captured) as server:
        server.run(reqs[0], "spin", timeout=120)  # warm
        order: list[tuple[str, str]] = []  # ("release" | "wake", request), as they happen
        release, finish = server.pool.release_requests, RequestHandle._finish

        def released(request_ids: list[str]) -> None:
            order.extend(("release", r) for r in request_ids)
            release(request_ids)

        def finished(handle: RequestHandle, *args: Any) -> None:
            order.append(("wake", handle.request_id))
            finish(handle, *args)

        monkeypatch.setattr(server.pool, "release_requests", released)
        monkeypatch.setattr(RequestHandle, "_finish", finished)
        futures = [server.submit_future(r, "spin", stream=False) for r in reqs]
        handles = [f.result(timeout=120) for f in futures]
        for r, h in zip(reqs, handles):
            assert_outputs_match(h.result(timeout=120), captured.run(r, "spin"))
        assert wait_for(lambda: len(order) == 2 * len(reqs)), order
        for h in handles:
            assert order.index(("release", h.request_id)) < order.index(("wake", h.request_id))
