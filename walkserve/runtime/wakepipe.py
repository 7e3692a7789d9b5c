"""A wake pipe: another thread (or a signal handler) makes a polling thread's poll return.

::

    wake = WakePipe()
    poller.register(wake.fd, zmq.POLLIN)   # the waiting thread polls it beside its sockets
    wake.set()                             # any thread: that poll returns
    wake.clear()                           # the woken thread, once it saw the wake
    wake.close()

Both ends are non-blocking: a full pipe means a wake is pending anyway. ``close`` marks the
pipe closed before it closes the descriptors, so a late ``set`` (a signal during shutdown)
writes nowhere.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["WakePipe"]


class WakePipe:
    """See the module docstring."""

    def __init__(self) -> None:
        self.fd, self._tx = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._tx, False)

    def set(self) -> None:
        """Make the poll that watches ``fd`` return (any thread)."""
        tx = self._tx
        if tx >= 0:
            with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: over
                os.write(tx, b"\0")

    def clear(self) -> None:
        """Take the pending wakes (the woken thread; after ``close``, nothing)."""
        if self.fd >= 0:
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 4096)

    def close(self) -> None:
        fds = (self.fd, self._tx)
        self.fd = self._tx = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
