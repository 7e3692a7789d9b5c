"""A burst of requests admitted in one conductor pass reaches its rank in chunks, and the rank
waits for the whole burst before it steps any of it.

Admitting a request in the server's conductor costs ~50-80 us on a small host (its walk's state
machine, its input checks), and reading it on the rank about as much again (decoding its
inputs, starting its region run). Sent as one message at the end of the pass, a burst of 16
had the rank idle while the server admitted all 16, then the server idle while the rank read
them: ~2 ms of a ~8 ms round of ``bench_loops``' 16 concurrent rollouts, one process after the
other. So a pass that finds every rank quiet (nothing out: ``Batcher.quiet``) admits
``ADMIT_CHUNK`` submissions at a time and sends each chunk's region starts at once
(``StartRegions(more=True)``: more of this pass may follow), and the rank reads a chunk while
the server admits the next. A pass while ranks have work out stays one dispatch, as before:
a busy rank would not hold the burst, so the chunks would only be more messages to it.

Stepping each chunk as it came would start them some steps apart: a cohort formed from the
first chunk, the others joining it later at other iterations, and its loop running the
stagger's extra steps at its end. So a rank that gets ``more=True`` while it has nothing else
to run holds (``BurstHold``): it takes commands and starts runs but steps nothing until the
pass's last region starts for it (``more=False``; the pass sends an empty one where its last
chunk had none for that rank), or ``BURST_HOLD_S`` after the first held chunk, whichever comes
first. The whole burst then forms one cohort, as it did when it came in one message, and its
first step is never later than that message would have arrived, as long as the pass ends
within the hold. A rank with runs of its own does not hold: they keep stepping and the burst
joins them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ADMIT_CHUNK", "BURST_HOLD_S", "BurstHold"]

# submissions a conductor pass admits before it sends the region starts they made: 2, 4 and 8
# gave the same 16-request rounds on 2 cores (a chunk is ~0.3 ms of admission there)
ADMIT_CHUNK = 4
# the longest a rank waits for the rest of a burst: a pass admitting ~64 requests on 2 cores
BURST_HOLD_S = 0.005


class BurstHold:
    """Whether a rank's engine loop waits for the rest of a burst before stepping (see the
    module docstring). The engine tells it of every message of region starts it takes
    (``starts``) and asks ``left()`` before each scheduling pass."""

    def __init__(
        self, hold_s: float = BURST_HOLD_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._until: float | None = None  # holding until then (None: not holding)
        self.holds = 0  # bursts held, for the rank's counters

    def starts(self, more: bool, idle: bool) -> None:
        """A message of region starts was taken: ``more``, the pass that sent it has more for
        this rank; ``idle``, the rank had nothing else to run before it."""
        if not more:  # the burst's last chunk (or no burst): step now
            self._until = None
        elif not self.left() and idle:  # a first chunk, and nothing else to step: hold
            self._until = self._clock() + self.hold_s
            self.holds += 1

    def left(self) -> float:
        """Seconds to wait still for the rest of a held burst (0: step now; a hold past its
        deadline ends, and the burst's later chunks find the rank busy: they join what runs)."""
        if self._until is None:
            return 0.0
        left = self._until - self._clock()
        if left <= 0:
            self._until = None
            return 0.0
        return left
