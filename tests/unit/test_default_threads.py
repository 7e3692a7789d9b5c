"""``default_threads``: the cores a host's workers share, one left to the conductor's process."""

from __future__ import annotations

import os

import pytest

from walkserve.runtime.config import default_threads


@pytest.mark.parametrize(
    ("cores", "ranks", "reserved", "want"),
    [
        (2, 1, 1, 1),  # a 2-core host: the worker gets one, the conductor the other
        (16, 1, 1, 15),
        (16, 2, 1, 7),
        (2, 2, 1, 1),  # never fewer than one
        (1, 1, 1, 1),
        (8, 1, 0, 8),  # a remote host with no conductor on it
        (8, 3, 0, 2),
    ],
)
def test_default_threads(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, reserved: int, want: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads(ranks, reserved) == want
