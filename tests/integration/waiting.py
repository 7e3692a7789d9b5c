"""Helpers of the tests with real processes (importable as ``waiting``: pytest puts this
directory on ``sys.path``): wait for a condition, and check that a server holds nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

from walkserve.runtime.server import Server


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def settled(server: Server) -> bool:
    """No live request, no live value (here or on a rank), no input slot in use."""
    stats = server.stats()
    return (
        stats.live_requests == 0 and stats.live_values == 0 and server.pool.shm_stats().in_use == 0
    )
