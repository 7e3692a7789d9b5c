"""``Passes``, who makes the conductor's passes: a posted task runs in a pass its poster makes;
submissions wait, queued, for the pass of their caller's first wait (on an ``Admission``: its
result, exception or a callback), or for the io thread once ``BURST_WAIT_S`` has passed, which
it is woken for; replies the io thread posts it runs itself. With a fake io thread and the
pass counted: no processes."""

from __future__ import annotations

from typing import Any

import pytest

from walkserve.runtime import passes
from walkserve.runtime.passes import Admission, Passes


class FakeIo:
    def __init__(self) -> None:
        self.io = False  # whether the caller is the io thread
        self.nudges: list[float | None] = []

    def on_io_thread(self) -> bool:
        return self.io

    def nudge(self, within_s: float | None = None) -> None:
        self.nudges.append(within_s)


def setup() -> tuple[Passes, FakeIo, list[int]]:
    io = FakeIo()
    sizes: list[int] = []  # tasks run by each pass

    def run() -> None:
        n = len(p.tasks)
        p.run_tasks()
        sizes.append(n)

    p = Passes(run, io)
    return p, io, sizes


def test_a_task_runs_in_a_pass_its_poster_makes() -> None:
    p, io, sizes = setup()
    ran: list[int] = []
    p.post(lambda: ran.append(1))
    p.post(lambda: ran.append(2))  # not a submission: no burst
    assert ran == [1, 2] and sizes == [1, 1] and io.nudges == []


def test_a_burst_waits_for_its_callers_first_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(passes, "BURST_WAIT_S", 60.0)  # however slow this host is
    p, io, sizes = setup()
    ran: list[int] = []
    for k in range(5):
        p.post(lambda k=k: ran.append(k), submission=True)
    assert ran == [] and sizes == []  # all queued, the first too
    assert io.nudges == [60.0]  # the io thread: once, for its deadline
    io.io = True
    p.pump()  # the io thread, woken before the deadline: the caller is still submitting
    assert ran == []
    io.io = False
    p.admit_waiting()  # the caller's first wait: one pass for all
    assert ran == [0, 1, 2, 3, 4] and sizes == [5]
    p.admit_waiting()  # nothing queued: no pass
    assert sizes == [5]


def test_a_lone_submission_is_admitted_by_its_callers_wait_at_once() -> None:
    p, _, sizes = setup()
    f = Admission(p)
    p.post(lambda: f.set_result("admitted"), submission=True)
    assert sizes == []
    assert f.result(timeout=0) == "admitted" and sizes == [1]  # no wait for a deadline


def test_the_io_thread_admits_a_burst_no_caller_waits_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(passes, "BURST_WAIT_S", 0.0)  # its deadline has passed
    p, io, sizes = setup()
    ran: list[int] = []
    for k in range(3):
        p.post(lambda k=k: ran.append(k), submission=True)
    io.io = True
    p.pump()
    assert ran == [0, 1, 2] and sizes == [3]


def test_replies_the_io_thread_posts_take_the_burst_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(passes, "BURST_WAIT_S", 60.0)
    p, io, sizes = setup()
    ran: list[str] = []
    p.post(lambda: ran.append("a"), submission=True)
    p.post(lambda: ran.append("b"), submission=True)
    io.io = True
    p.post(lambda: ran.append("reply"))  # queued: the io thread's own pass follows
    p.pump()
    assert ran == ["a", "b", "reply"] and sizes == [3]


@pytest.mark.parametrize("how", ["result", "exception", "callback"])
def test_waiting_on_an_admission_makes_the_pass(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(passes, "BURST_WAIT_S", 60.0)
    p, _, sizes = setup()
    futures: list[Admission] = []
    for k in range(3):
        f = Admission(p)
        futures.append(f)
        p.post(lambda f=f, k=k: f.set_result(k), submission=True)
    called: list[Any] = []
    last = futures[-1]
    if how == "result":
        assert last.result(timeout=5) == 2
    elif how == "exception":
        assert last.exception(timeout=5) is None
    else:
        last.add_done_callback(called.append)
        assert called == [last]
    assert sizes == [3]


def test_nothing_runs_once_stopped() -> None:
    p, _, sizes = setup()
    p.stopped = True
    p.post(lambda: None)
    assert sizes == [] and len(p.tasks) == 1


def test_a_wait_while_the_io_thread_is_in_a_pass_has_it_admit_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's wait finds the io thread in a pass (finishing the request before), so it
    cannot make one: the io thread's next pass admits the submission, not its deadline's."""
    monkeypatch.setattr(passes, "BURST_WAIT_S", 60.0)
    p, io, sizes = setup()
    f = Admission(p)
    p.post(lambda: f.set_result("admitted"), submission=True)
    with p.lock:  # the io thread's pass
        assert f.done() is False
        p.admit_waiting()  # the caller's wait: no pass of its own
        assert sizes == []
    io.io = True
    p.pump()  # the io thread after its pass, 60 s before the deadline
    assert sizes == [1] and f.result(timeout=0) == "admitted"
