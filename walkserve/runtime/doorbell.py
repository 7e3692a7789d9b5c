"""A doorbell: a counter in a page two processes map, which the conductor rings after each
write to a rank's link and the rank reads between its fast lane's steps, where it would
otherwise poll the link's socket::

    bell = Doorbell.create(path)     # the conductor, when it accepts the rank's link
    bell.ring()                      # after bytes were written to that link
    bell = Doorbell.open(path)       # the rank (None: there is none, poll the socket)
    bell.rung()                      # written to since the last ``seen()``? (a memory read)
    bell.seen()                      # before reading the socket

Why: a poll of the socket is a system call, and between the steps of a small model a system
call costs several times what it costs alone (the rollout of ``bench_loops``, ~90-100 us a step
on the 2-core VM: ~3-5 us a step asked at every step). A rank asks at every step whether a
command waits, so that a request that arrives joins the running cohort at the next step.

Never wrong, at worst late by the other side's next instruction: the conductor rings after
its bytes are in the socket, and the rank marks the count ``seen`` before it reads, so any
write it did not read has rung since; a ring whose bytes it read anyway (read before the count
moved) only makes it look once more and find nothing. A blocking wait polls the socket itself.
The file lives in the conductor's private (0700) directory, named by the rank and its
generation (a restarted rank gets a new one), created with ``O_EXCL`` (a second link of the
same process replaces it), removed with the link.
"""

from __future__ import annotations

import contextlib
import mmap
import os

__all__ = ["Doorbell", "bell_path"]

_SIZE = 8  # one unsigned 64-bit count
_WRAP = (1 << 64) - 1


def bell_path(directory: str, rank: int, generation: int) -> str:
    """The doorbell of ``rank``'s process of ``generation`` in the link ``directory``."""
    return os.path.join(directory, f"bell-{rank}-{generation}")


class Doorbell:
    """See the module docstring."""

    def __init__(self, mapped: mmap.mmap, path: str, owner: int | None) -> None:
        self._mapped = mapped
        self._count = memoryview(mapped).cast("Q")
        self._seen = 0
        self._rings = 0  # the ringer's own count: it alone writes the page
        self.path = path
        self._owner = owner  # the ringer's: its file's inode, removed when closed

    @classmethod
    def create(cls, path: str, replace: bool = False) -> Doorbell:
        """A new doorbell at ``path``, rung by this process; ``replace``: in place of one
        there (another link's of the same rank, which then no longer removes it), else
        ``FileExistsError``."""
        if replace:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            mapped = mmap.mmap(fd, _SIZE)
            inode = os.fstat(fd).st_ino
        except OSError:  # no doorbell: none left behind for the rank to find
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(mapped, path, owner=inode)

    @classmethod
    def open(cls, path: str) -> Doorbell | None:
        """The doorbell at ``path``, to watch; None where there is none (or not one of ours)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != _SIZE:
                return None
            mapped = mmap.mmap(fd, _SIZE)
        except OSError:
            return None
        finally:
            os.close(fd)
        return cls(mapped, path, owner=None)  # nothing seen yet: the next ``rung`` reads

    def ring(self) -> None:
        """Say that bytes were written (after writing them)."""
        self._rings = (self._rings + 1) & _WRAP
        self._count[0] = self._rings

    def rung(self) -> bool:
        """Whether it was rung since the last ``seen``."""
        return bool(self._count[0] != self._seen)

    def seen(self) -> None:
        """Take the rings so far as seen (before reading what they announce)."""
        self._seen = self._count[0]

    def close(self) -> None:
        """The ringer removes the file. The page stays mapped until the doorbell is dropped, so
        that a ring or a look racing the close of its link reads and writes a page still
        there (and nothing then looks at it)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == owner:  # not a later ringer's
                    os.unlink(self.path)
