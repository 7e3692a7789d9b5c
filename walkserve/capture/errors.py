"""Capture errors: every one names the rule that was broken and the user's source line."""

from __future__ import annotations

import linecache
import os
import sys
from types import FrameType

import torch

_SKIP_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # walkserve/capture itself
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


class CaptureError(Exception):
    """A model cannot be captured as written. The message says which rule and where."""

    def __init__(self, rule: str, message: str, source: str | None = None) -> None:
        self.rule = rule
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{message} [rule: {rule}]")


def user_frame() -> FrameType | None:
    """The innermost frame that belongs to user code (not torch, not walkserve.capture)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP_DIRS) and not filename.startswith("<"):
            return frame
        frame = frame.f_back  # type: ignore[assignment]
    return None


def user_source() -> str | None:
    """``"path:line"`` of the user's line now executing, relative to the cwd when shorter."""
    frame = user_frame()
    if frame is None:
        return None
    path = frame.f_code.co_filename
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    except ValueError:
        pass
    return f"{path}:{frame.f_lineno}"


def source_text(source: str | None) -> str:
    """The text of a ``path:line`` source location, stripped, or ``""``."""
    if not source:
        return ""
    path, _, line = source.rpartition(":")
    try:
        return linecache.getline(path, int(line)).strip()
    except (ValueError, OSError):
        return ""
