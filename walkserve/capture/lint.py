"""lint(): the IR's structural invariants (filled in below)."""

from __future__ import annotations

from walkserve.capture import ir


def lint(graph: ir.WalkGraph) -> None:
    return None
