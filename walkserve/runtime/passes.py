"""Who makes the server's conductor passes, and when: ``Passes`` queues the tasks other
threads post for the conductor (a submission, a cancel, a worker's reply) and runs them in
passes, one at a time, on no thread of its own::

    post(task)            a caller's thread: queue it, then make a pass itself when no
                          other thread is in one (no hand-off to wait for)
    io thread             after every batch of replies it reads (``WorkerPool.on_io_pass``)
    post(submission)      only queued: the caller's first wait makes the pass
                          (``admit_waiting``: ``Admission``, ``RequestHandle``), the io thread
                          BURST_WAIT_S after the first queued one if no caller waits

A caller that submits and waits (``run()``) makes the pass when it waits, on its own thread
right after submitting: no later than a pass made at the submission. A burst's submissions
(a batch submitted in a loop) are admitted in that one pass and step together from their
first step (onto a quiet rank in chunks it holds until the last: ``burst``); a pass for the
first at its submission sent it alone, to step alone once and be joined a step later by the
rest (~5% of a 16-request round of bench_loops' loops), and a pass each (~0.1 ms of the
caller's thread) started them one engine step apart and on a small host kept the worker's
socket thread off the cores until they were all made.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

__all__ = ["BURST_WAIT_S", "Admission", "Passes"]

# when the io thread admits submissions no caller has waited on yet, after the first of them
BURST_WAIT_S = 1e-3


class IoThread(Protocol):
    """What ``Passes`` needs of the pool: whether the caller is its io thread, and a wake."""

    def on_io_thread(self) -> bool: ...

    def nudge(self, within_s: float | None = None) -> None: ...


class Passes:
    """See the module docstring. ``run`` is one pass (it calls ``run_tasks`` first)."""

    def __init__(self, run: Callable[[], None], io: IoThread) -> None:
        self._run, self._io = run, io
        self.tasks: collections.deque[Callable[[], None]] = collections.deque()
        self.lock = threading.Lock()  # one pass at a time: the conductor is not shared
        self.stopped = False  # closed, or stopped by faults: no pass runs any more
        self._deferred = 0  # submissions queued for their callers' first wait
        self._deferred_until = 0.0  # when the io thread admits them if no caller did

    def post(self, task: Callable[[], None], submission: bool = False) -> None:
        """Queue ``task`` for the next pass (see the module docstring); ``submission``: an
        admission, which waits for its caller's first wait and goes with whatever else is
        queued by then."""
        self.tasks.append(task)
        if self._io.on_io_thread():
            return
        if submission:
            self._deferred += 1
            if self._deferred == 1:
                self._deferred_until = time.monotonic() + BURST_WAIT_S
                self._io.nudge(within_s=BURST_WAIT_S)
        else:
            self.pump(once=True)

    def admit_waiting(self) -> None:
        """Make the pass that runs the tasks still queued (a burst's submissions), if one is
        due: a caller about to wait on one of them."""
        if self.tasks and not self._io.on_io_thread():
            # a caller waits: nothing is held back for its burst any more. Set first, so that
            # where the io thread is in a pass just now (this pump cannot make one), it makes
            # the next one for these tasks at once, not at their deadline
            self._deferred_until = 0.0
            self.pump(once=True)

    def pump(self, once: bool = False) -> None:
        """Make passes while tasks wait and no other thread is in one (that one sees them:
        it makes another pass, or, ``once``, a caller's thread making one pass, wakes the io
        thread for the rest). ``once``: so that a caller (the HTTP event loop) is not kept
        on the conductor's work by a stream of replies. The io thread leaves queued
        submissions alone until ``BURST_WAIT_S`` after the first: their caller may still be
        submitting."""
        while self.tasks and not self.stopped:
            if (
                self._deferred >= len(self.tasks)
                and time.monotonic() < self._deferred_until
                and self._io.on_io_thread()
            ):
                return
            if not self.lock.acquire(blocking=False):
                return
            try:
                if not self.stopped:
                    self._run()
            finally:
                self.lock.release()
            if once:
                if self.tasks:
                    self._io.nudge()
                return

    def run_tasks(self, limit: int | None = None) -> None:
        """Run the queued tasks in order, at most ``limit`` of them (the start of a pass, or
        of one of its chunks: ``ConductorPass._admit``)."""
        self._deferred = 0
        n = 0
        while self.tasks and (limit is None or n < limit):
            self.tasks.popleft()()
            n += 1


class Admission(Future):  # type: ignore[type-arg]
    """A submission's future: a caller about to wait on it, or to be called back by it (as
    ``asyncio.wrap_future``), first makes the pass that admits the submissions still queued
    (``Passes.admit_waiting``)."""

    def __init__(self, passes: Passes) -> None:
        super().__init__()
        self._passes = passes

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._passes.admit_waiting()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._passes.admit_waiting()
        return super().exception(timeout)

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        super().add_done_callback(fn)
        if not self.done():
            self._passes.admit_waiting()
