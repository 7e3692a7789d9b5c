"""``DoubleBufferedPlanner``: attention metadata for step N+1 built on a background thread while
step N runs, over any ``attention.AttentionBackend``.

Owns the two plan slots and the rule that a plan is never built into the slot a running step
reads; the backends own what a plan holds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic

from walkserve.runtime.kv.attention import (
    NUM_PLAN_SLOTS,
    AttentionBackend,
    AttentionMetadata,
    P,
    SequenceSpec,
)

__all__ = ["DoubleBufferedPlanner"]


class DoubleBufferedPlanner(Generic[P]):
    """Builds the metadata for step N+1 on a background thread while step N runs: the CPU twin
    of FlashInfer's ``plan``/``run`` split, with two metadata buffers (slots)::

        planner.submit(batch_0)
        meta = planner.take()                  # slot 0, now in use
        loop:
            planner.submit(batch_next)         # planned into slot 1 on the planning thread
            out = model_step(meta)             # ... while step N runs on slot 0
            meta = planner.take()              # slot 1 in use; slot 0 free for N+2

    Invariant: a plan is only ever built into the slot that is *not* in use, and the in-use
    slot changes only in ``take``, which waits for the pending plan. So planning step N+1 never
    writes the buffer (metadata, or backend state such as a FlashInfer wrapper) that step N
    reads. At most one plan is pending; ``submit`` twice without ``take`` is an error. A plan
    that raised re-raises from ``take`` and leaves the in-use slot as it was.
    """

    def __init__(self, backend: AttentionBackend[P]) -> None:
        self.backend = backend
        self._buffers: list[AttentionMetadata[P] | None] = [None] * NUM_PLAN_SLOTS
        self._in_use: int | None = None
        self._pending: tuple[int, Future[AttentionMetadata[P]]] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attention-plan")
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int | None:
        """The slot the current step reads, or None before the first ``take``."""
        return self._in_use

    def buffer(self, slot: int) -> AttentionMetadata[P] | None:
        """The metadata last planned into ``slot``."""
        return self._buffers[slot]

    def submit(self, batch: Sequence[SequenceSpec]) -> None:
        """Start planning the next step into the free slot; returns at once."""
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("a plan is already pending: take() it before submitting")
            slot = 0 if self._in_use is None else (self._in_use + 1) % NUM_PLAN_SLOTS
            specs = tuple(batch)  # the caller may mutate its list after submit returns
            self._pending = (slot, self._executor.submit(self._plan, specs, slot))

    def take(self) -> AttentionMetadata[P]:
        """Wait for the pending plan and make its slot the one in use."""
        with self._lock:
            if self._pending is None:
                raise RuntimeError("no plan pending: submit() a batch first")
            slot, future = self._pending
            self._pending = None
        metadata = future.result()
        self._in_use = slot
        return metadata

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> DoubleBufferedPlanner[P]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, batch: tuple[SequenceSpec, ...], slot: int) -> AttentionMetadata[P]:
        if slot == self._in_use:  # unreachable by construction; guards the invariant
            raise RuntimeError(f"refusing to plan into slot {slot}, which a running step reads")
        metadata = self.backend.plan(batch, slot)
        self._buffers[slot] = metadata
        return metadata
