"""Start-up progress of ``walkserve serve`` on stderr: named stages, each shown with the seconds
elapsed since start-up began. Owns only the display; callers say when a stage begins.

Not a terminal (a log, a pipe), one line per stage::

    walkserve: [  0.0 s] loading weights
    walkserve: [  1.2 s] capturing walks
    walkserve: [  2.9 s] lowering
    walkserve: [  3.0 s] starting 1 worker
    walkserve: [  9.4 s] ready

A terminal: one line rewritten in place (``\\r`` and erase-to-end), ended by a newline at
``ready``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

Stage = Callable[[str], None]  # called with a stage's name as it begins


class StartupProgress:
    def __init__(
        self,
        stream: TextIO | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.t0 = clock()
        self.stages: list[str] = []

    def stage(self, name: str) -> None:
        """Show that stage ``name`` begins now."""
        self.stages.append(name)
        line = f"walkserve: [{self.clock() - self.t0:5.1f} s] {name}"
        if self.tty:
            end = "\n" if name == "ready" else ""
            self.stream.write(f"\r\x1b[K{line}{end}")
        else:
            self.stream.write(f"{line}\n")
        self.stream.flush()

    def abandon(self) -> None:
        """End an in-place line left open by a failed start-up, so errors start on their own
        line."""
        if self.tty and self.stages and self.stages[-1] != "ready":
            self.stream.write("\n")
            self.stream.flush()
