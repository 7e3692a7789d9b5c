"""``walkserve serve`` start-up progress display, with a fake clock and an in-memory stream."""

from __future__ import annotations

import io
from collections.abc import Iterator

from walkserve.progress import StartupProgress


def _clock(times: list[float]) -> Iterator[float]:
    yield from times


def test_one_line_per_stage_when_not_a_terminal() -> None:
    out = io.StringIO()
    ticks = _clock([10.0, 10.0, 11.25, 13.5])
    progress = StartupProgress(out, tty=False, clock=lambda: next(ticks))
    for name in ("loading weights", "lowering", "ready"):
        progress.stage(name)
    assert out.getvalue().splitlines() == [
        "walkserve: [  0.0 s] loading weights",
        "walkserve: [  1.2 s] lowering",
        "walkserve: [  3.5 s] ready",
    ]


def test_one_rewritten_line_on_a_terminal() -> None:
    out = io.StringIO()
    ticks = _clock([0.0, 0.0, 2.0])
    progress = StartupProgress(out, tty=True, clock=lambda: next(ticks))
    progress.stage("loading weights")
    progress.stage("ready")
    text = out.getvalue()
    assert (
        text == "\r\x1b[Kwalkserve: [  0.0 s] loading weights\r\x1b[Kwalkserve: [  2.0 s] ready\n"
    )
    progress.abandon()  # already ended by "ready": nothing more
    assert out.getvalue() == text


def test_abandon_ends_an_open_terminal_line() -> None:
    out = io.StringIO()
    progress = StartupProgress(out, tty=True)
    progress.stage("lowering")
    progress.abandon()
    assert out.getvalue().endswith("lowering\n")
