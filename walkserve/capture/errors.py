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
        if _is_user_file(filename):
            return frame
        frame = frame.f_back  # type: ignore[assignment]
    return None


def user_source() -> str | None:
    """``"path:line"`` of the user's line now executing, relative to the cwd when shorter."""
    frame = user_frame()
    if frame is None:
        return None
    return _location(frame.f_code.co_filename, frame.f_lineno)


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_SKIP_DIRS) and not filename.startswith("<")


def _location(path: str, line: int) -> str:
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    except ValueError:
        pass
    return f"{path}:{line}"


def source_text(source: str | None) -> str:
    """The text of a ``path:line`` source location, stripped, or ``""``."""
    if not source:
        return ""
    path, _, line = source.rpartition(":")
    try:
        return linecache.getline(path, int(line)).strip()
    except (ValueError, OSError):
        return ""


# What plain Python asks of a value that is only traced while capturing, and what to write
# instead: (words in the error, rule, advice).
_TRACED_VALUE_ADVICE = (
    (
        "cannot be interpreted as an integer",
        "python-int",
        "a Python int is needed where the value is traced (a walk input or a tensor). For a "
        "loop count write range(n) or iterations(n) in the walk or loop body itself (an int "
        "walk input, or + - * // % of them); for a shape, pass tensor sizes (x.shape[1])",
    ),
    (
        "int() argument",
        "python-scalar",
        "int() of a traced value: its number is not known while capturing. Keep it a tensor "
        "(x.long()), or, for a loop bound, iterate range(n) over the int walk input itself",
    ),
    (
        "float() argument",
        "python-scalar",
        "float() of a traced value: its number is not known while capturing. Keep it a "
        "tensor (x.float()), or pass the number as a float walk input",
    ),
    (
        "'len' is not supported",
        "len-of-traced",
        "len() of a traced value in a module capture does not patch: call it in the walk's "
        "own module, or use x.shape[0]",
    ),
    (
        "cannot be iterated",
        "iterate-traced",
        "a traced value is iterated; loop over its indices (for k in range(x.shape[1]): "
        "x[:, k]) or unpack a fixed number of items (a, b = out)",
    ),
    (
        "Generator",
        "rng-generator",
        "random numbers in a walk: g = torch.Generator().manual_seed(seed) (seed: an int or "
        "an int walk input) in the walk body, then torch.randn(..., generator=g)",
    ),
    (
        "Proxy",
        "traced-value",
        "plain Python needed a concrete value where capture only has a traced one; compute it "
        "with torch operations on tensors, or pass it as a walk input",
    ),
)


def traced_value_error(error: BaseException) -> CaptureError:
    """A ``CaptureError`` for an exception the walk raised while it was traced: the user's
    innermost line in its traceback, and advice when it is a known traced-value pattern."""
    source = None
    tb = error.__traceback__
    while tb is not None:
        if _is_user_file(tb.tb_frame.f_code.co_filename):
            source = _location(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    text = f"{type(error).__name__}: {error}"
    for words, rule, advice in _TRACED_VALUE_ADVICE:
        if words in text:
            return CaptureError(rule, f"{advice} ({text})", source)
    return CaptureError("walk-raised", f"the walk raised {text} while it was captured", source)
