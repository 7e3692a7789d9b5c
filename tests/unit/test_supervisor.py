"""The supervision policy (``runtime.supervisor``) with a fake clock: hang deadlines, restart
back-off, crash loops that give up, and a quiet rank whose old deaths leave the window."""

from __future__ import annotations

import pytest

from walkserve.runtime.config import PoolConfig, SupervisionConfig
from walkserve.runtime.supervisor import GiveUp, Restart, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_rank_is_hung_only_past_its_deadline() -> None:
    clock = Clock()
    sup = Supervisor(SupervisionConfig(hang_deadline_s=2.0), clock)
    assert not sup.hung(None)  # never heard from: starting, not hung
    assert not sup.hung(99.0)
    clock.now = 101.9
    assert not sup.hung(99.95)
    assert sup.hung(99.0)
    assert not Supervisor(SupervisionConfig(hang_deadline_s=None), clock).hung(0.0)


def test_restarts_back_off_then_a_crash_loop_gives_up() -> None:
    clock = Clock()
    sup = Supervisor(
        SupervisionConfig(max_restarts=3, restart_window_s=60, restart_backoff_s=0.5), clock
    )
    assert sup.died(0) == Restart(0.0, 1)
    clock.now += 1
    assert sup.died(0) == Restart(0.5, 2)
    clock.now += 1
    assert sup.died(0) == Restart(1.0, 3)
    assert sup.died(1) == Restart(0.0, 1)  # ranks are counted apart
    clock.now += 1
    decision = sup.died(0)
    assert isinstance(decision, GiveUp)
    assert "rank 0 died 4 times within 60 s" in decision.reason
    assert sup.restarts(0) == 3 and sup.restarts(1) == 1 and sup.restarts(2) == 0


def test_deaths_older_than_the_window_are_forgotten() -> None:
    clock = Clock()
    sup = Supervisor(SupervisionConfig(max_restarts=1, restart_window_s=10), clock)
    assert isinstance(sup.died(0), Restart)
    clock.now += 11
    assert sup.died(0) == Restart(0.0, 2)  # a death a while ago is not a crash loop
    clock.now += 1
    assert isinstance(sup.died(0), GiveUp)


def test_restarts_off_gives_up_at_once() -> None:
    decision = Supervisor(SupervisionConfig(restart=False), Clock()).died(3)
    assert isinstance(decision, GiveUp) and "restarts are off" in decision.reason


@pytest.mark.parametrize(
    "bad",
    [{"hang_deadline_s": 0}, {"max_restarts": -1}, {"restart_window_s": -1.0}],
)
def test_bad_supervision_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SupervisionConfig(**bad)  # type: ignore[arg-type]
    assert PoolConfig().supervision.hang_deadline_s == 10.0


def test_a_rank_whose_reports_wait_unread_is_not_called_hung() -> None:
    """``RankSupervision.tick`` (the pool's io thread) reads what waits before it kills: a
    thread kept from its reads (the GIL, a long pass) finds a rank's heartbeats queued, not a
    hung rank. A rank that sent nothing is still killed."""
    import time
    from types import SimpleNamespace

    from walkserve.runtime.poolsupervision import RankSupervision

    class Process:
        killed = 0

        def kill(self) -> None:
            self.killed += 1

    silent = time.monotonic() - 5.0  # past a 2 s deadline
    queued = SimpleNamespace(rank=0, status="ready", last_seen=silent, hung=None, pid=1)
    mute = SimpleNamespace(rank=1, status="ready", last_seen=silent, hung=None, pid=2)
    queued.process, mute.process = Process(), Process()
    drains: list[int] = []

    def drain_reports(wait_ms: int = 20) -> None:  # rank 0's heartbeats were waiting
        drains.append(wait_ms)
        queued.last_seen = time.monotonic()

    pool = SimpleNamespace(
        config=PoolConfig(supervision=SupervisionConfig(hang_deadline_s=2.0)),
        _ranks={0: queued, 1: mute},
        _closed=False,
        _drain_reports=drain_reports,
    )
    RankSupervision(pool).tick()  # type: ignore[arg-type]
    assert drains == [0]  # read once, without waiting
    assert queued.process.killed == 0 and queued.hung is None
    assert mute.process.killed == 1 and "sent nothing" in mute.hung
