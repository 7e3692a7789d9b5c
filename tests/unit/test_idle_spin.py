"""A worker's idle spin: when it is on (``idle_spin``), and how the inbox waits with it
(``WorkerInbox._wait``: polls without sleeping only within ``idle_spin_s`` of its last work,
then sleeps in one poll). The poller is a fake that records its timeouts: no socket, no clock
assertion."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from walkserve.runtime import workerinbox
from walkserve.runtime.config import IDLE_SPIN_S, PoolConfig, WorkerConfig, idle_spin
from walkserve.runtime.workerinbox import WAIT_MS, WorkerInbox


@pytest.mark.parametrize(
    ("cores", "ranks", "threads", "want"),
    [
        (2, 1, 1, IDLE_SPIN_S),  # a 2-core host, one worker of one thread: a core to spare
        (2, 2, 1, 0.0),  # each core has a worker: a spinning one would take the conductor's
        (2, 1, 2, 0.0),
        (16, 2, 7, IDLE_SPIN_S),
        (16, 2, 8, 0.0),
    ],
)
def test_idle_spin_default_needs_a_spare_core(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, threads: int, want: float
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert idle_spin(None, ranks, threads) == want
    assert idle_spin(0.0, ranks, threads) == 0.0  # what the deployer set wins
    assert idle_spin(0.02, ranks, threads) == 0.02


@pytest.mark.parametrize("bad", [-0.001, 1.5])
def test_idle_spin_bounds(bad: float) -> None:
    with pytest.raises(ValueError, match="idle_spin_s"):
        PoolConfig(idle_spin_s=bad)
    with pytest.raises(ValueError, match="idle_spin_s"):
        WorkerConfig(threads=1, commands_addr="ipc:///x", idle_spin_s=bad)
    text = WorkerConfig(threads=1, commands_addr="ipc:///x", idle_spin_s=0.004).to_json()
    assert WorkerConfig.from_json(text).idle_spin_s == 0.004


class FakePoller:
    """Answers the ``n``-th poll (0-based) with a ready socket, and records each timeout."""

    def __init__(self, ready_at: int | None) -> None:
        self.ready_at = ready_at
        self.timeouts: list[int] = []

    def poll(self, timeout: int) -> list[Any]:
        self.timeouts.append(timeout)
        return [("socket", 1)] if len(self.timeouts) - 1 == self.ready_at else []


def inbox(spin: float, busy_at: float, poller: FakePoller) -> WorkerInbox:
    box = WorkerInbox()
    box.idle_spin_s = spin
    box._busy_at = busy_at
    box._poller = poller  # type: ignore[assignment]
    return box


def test_wait_spins_after_work_and_reads_what_comes() -> None:
    poller = FakePoller(ready_at=3)
    assert inbox(60.0, time.perf_counter(), poller)._wait()
    assert poller.timeouts == [0, 0, 0, 0]  # never asleep: the 4th poll found the command


def test_wait_sleeps_when_idle_or_off() -> None:
    long_ago = time.perf_counter() - 10.0
    for box_spin, busy_at in [(0.005, long_ago), (0.0, time.perf_counter())]:
        poller = FakePoller(ready_at=None)
        assert not inbox(box_spin, busy_at, poller)._wait()
        assert poller.timeouts == [WAIT_MS]  # one sleeping poll, no spin


def test_wait_ends_its_spin_and_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.001, 0.002, 0.003, 1.0])  # the window ends at the 5th reading
    monkeypatch.setattr(workerinbox.time, "perf_counter", lambda: next(clock))
    yields: list[int] = []
    monkeypatch.setattr(workerinbox.os, "sched_yield", lambda: yields.append(1))
    poller = FakePoller(ready_at=None)
    assert not inbox(0.5, 0.0, poller)._wait()
    assert poller.timeouts == [0, 0, 0, 0, WAIT_MS]
    assert len(yields) == 4  # the core is offered to others between polls
