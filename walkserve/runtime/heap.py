"""A long-lived process's heap and Python's cyclic garbage collector.

A worker holds its model, captured graph, plan and torch's own objects for its whole life:
some 200k objects that every full collection of the cyclic collector walks again (about 0.1 s
on this project's 2-core host), while every request in flight waits. Under steady load a
worker ran one every ~9 s (three in 27 s of 16 concurrent rollouts of ``bench_loops``'s model,
80 ms each). ``freeze`` moves what exists once the process is set up out of the collector's
sight (``gc.freeze``: never collected, never walked again), so that a full collection walks
only what serving made since; ``counters`` says what it froze and how many full collections
ran (a rank's ``stats()`` counters ``gc/...``)."""

from __future__ import annotations

import gc

__all__ = ["counters", "freeze"]


def freeze() -> int:
    """Collect what setting up left behind, then freeze the rest: how many objects it froze.
    Call it once the process holds what it keeps for its life (a worker: after its build)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def counters() -> dict[str, int]:
    """The frozen objects, and the full collections run so far."""
    return {
        "gc/frozen_objects": gc.get_freeze_count(),
        "gc/full_collections": gc.get_stats()[2]["collections"],
    }
