"""``WakePipe``: a set makes its descriptor readable until cleared; a set after close is a
no-op, and many sets never block."""

from __future__ import annotations

import select

from walkserve.runtime.wakepipe import WakePipe


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_set_wakes_until_cleared_and_nothing_after_close() -> None:
    wake = WakePipe()
    assert not _readable(wake.fd)
    wake.set()
    assert _readable(wake.fd)
    wake.clear()
    assert not _readable(wake.fd)
    for _ in range(100_000):  # more than a pipe holds: the full pipe drops the rest
        wake.set()
    assert _readable(wake.fd)
    wake.clear()
    wake.close()
    assert wake.fd == -1
    wake.set()  # a late wake (a signal handler during shutdown): nothing, no error
    wake.clear()  # neither on a closed pipe
