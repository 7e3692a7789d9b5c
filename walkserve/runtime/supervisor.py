"""The supervision policy of the worker ranks: when a silent rank counts as hung, whether a
dead one is started again and after how long, and when a crash loop gives up.

Pure: no processes, sockets or threads; the clock is a parameter (tests pass a fake one). The
worker pool (``pool``) asks it and acts: it kills a hung rank (SIGKILL, which then dies like
any other), fails the requests a dead rank had in flight (no retry: a walk's side effects on
other ranks, streamed items already sent, cannot be undone), and restarts it with the same
``WorkerSetup`` when told to::

    supervisor = Supervisor(SupervisionConfig(), clock=time.monotonic)
    supervisor.hung(last_seen)     # True: silent past hang_deadline_s -> kill it
    supervisor.died(rank)          # Restart(after_s) | GiveUp(reason): a crash loop stops
    supervisor.restarts(rank)      # restarts so far (``/health``)

A crash loop: a rank that dies more than ``max_restarts`` times within ``restart_window_s``
is given up (the pool marks it ``failed``; ``/health`` answers 503). Restarts in a row back
off: the n-th death within the window waits ``restart_backoff_s * 2**(n - 2)``, the first
none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from walkserve.runtime.config import SupervisionConfig

__all__ = ["GiveUp", "Restart", "Supervisor"]


@dataclass(frozen=True)
class Restart:
    """Start the rank again in ``after_s`` seconds; it is its ``restart``-th restart."""

    after_s: float
    restart: int


@dataclass(frozen=True)
class GiveUp:
    """Do not start the rank again: ``reason`` says why (a line for the log and ``/health``)."""

    reason: str


class Supervisor:
    """See the module docstring."""

    def __init__(
        self, config: SupervisionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._deaths: dict[int, list[float]] = {}  # rank -> times of its deaths in the window
        self._restarts: dict[int, int] = {}

    def hung(self, last_seen: float | None) -> bool:
        """Whether a ready rank last heard from at ``last_seen`` (the clock's time) is past
        its deadline."""
        deadline = self.config.hang_deadline_s
        if deadline is None or last_seen is None:
            return False
        return self._clock() - last_seen > deadline

    def died(self, rank: int) -> Restart | GiveUp:
        """Rank ``rank`` died now: restart it (after how long), or give it up."""
        now = self._clock()
        window = self.config.restart_window_s
        recent = [t for t in self._deaths.get(rank, []) if now - t < window] + [now]
        self._deaths[rank] = recent
        if not self.config.restart:
            return GiveUp(f"rank {rank} died and restarts are off")
        if len(recent) > self.config.max_restarts:
            return GiveUp(
                f"rank {rank} died {len(recent)} times within {window:g} s "
                f"(at most {self.config.max_restarts} restarts); not restarting it again"
            )
        self._restarts[rank] = self._restarts.get(rank, 0) + 1
        after = 0.0 if len(recent) == 1 else self.config.restart_backoff_s * 2 ** (len(recent) - 2)
        return Restart(after, self._restarts[rank])

    def restarts(self, rank: int) -> int:
        return self._restarts.get(rank, 0)
