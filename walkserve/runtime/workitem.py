r"""Work items and events: what the conductor hands its runners and what it tells its server.

The conductor (``conductor``) and a rank's scheduler (``rankscheduler``) exchange these with
whoever runs their items (the server and its workers, ``local.run_local``): plain frozen
dataclasses, no behaviour. ``WorkItem`` goes out (``Conductor.ready``); results come back
through ``Conductor.complete`` and friends; ``Event``\s go to clients; ``Feed`` and ``Credit``
move streams between regions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

NodeKind = Literal["component", "glue", "region", "loop"]
UNLIMITED = 1 << 62  # a credit that never holds a producer back


@dataclass(frozen=True)
class LoopStart:
    """A loop item's start (``kind="loop"``): its runner runs the loop ``loop`` by itself for
    at most ``bound`` iterations and completes the item with ``channels``; the accumulated
    channels in ``streams`` it reports as each iteration commits (``streamed``). ``carried``,
    ``fixed``: the parameters' initial and invariant values; ``sources``: a per-step slice's
    source value, or a table's values (a list), by parameter."""

    loop: str
    bound: int
    carried: dict[str, Any]
    fixed: dict[str, Any]
    sources: dict[str, Any]
    channels: tuple[str, ...]
    streams: tuple[str, ...]


@dataclass(frozen=True)
class WorkItem:
    """Ops of one plan node for one request at one loop iteration, inputs materialized.

    ``ops`` are the IR op names to run, in order; for ``kind="component"`` the first is the
    component op, called with ``call`` = (args, kwargs), and the rest is glue fused into it.
    ``kind="region"``: ``node`` names a ``RegionPlan`` of the walk, which its rank runs by
    itself; ``env`` holds its inputs, ``outputs`` the values it reports at its exit
    (``complete``), and its streamed channels' items come before that (``streamed``).
    ``env`` holds every value the item's glue ops read from outside the item (by name; model
    attributes and constants are resolved by the runner). ``frame`` is the loop iteration path,
    outer to inner (``()`` outside loops). ``speculative``: dispatched before the stop of the
    previous iteration was known. ``outputs``: the ops whose values are read after the item
    (by later items, the client or the frame's end); the others are used inside the item only
    and need not come back. Report with ``complete(id, {op: value for op in outputs})`` (more
    values are ignored); a map item (``calls``) with a list of those, one per call.
    """

    id: int
    request: str
    walk: str
    node: str
    kind: NodeKind
    ops: tuple[str, ...]
    frame: tuple[int, ...]
    speculative: bool
    call: tuple[list[Any], dict[str, Any]] | None = field(default=None, repr=False)
    env: Mapping[str, Any] = field(default_factory=dict, repr=False)
    outputs: tuple[str, ...] = ()
    loop: LoopStart | None = field(default=None, repr=False)
    stream: bool = True  # a region item: report its client streams item by item
    # a map's iterations (``Conductor(maps=...)``): one call each, run as one item (its
    # result holds each iteration's values in order: ``ItemResult.each``); ``call`` is None
    calls: tuple[tuple[list[Any], dict[str, Any]], ...] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Output:
    """A client output of walk ``walk``, at the walk's end."""

    request: str
    walk: str
    name: str
    value: Any


@dataclass(frozen=True)
class StreamItem:
    """Iteration ``index``'s contribution to client output ``channel`` (an accumulated
    channel of a walk-level loop), as soon as that iteration commits. The final ``Output`` of
    ``channel`` is these values joined as the loop's accumulation says (cat or stack)."""

    request: str
    channel: str
    index: int
    value: Any


@dataclass(frozen=True)
class Finished:
    request: str


@dataclass(frozen=True)
class Failed:
    request: str
    error: str


Event = Output | StreamItem | Finished | Failed


@dataclass(frozen=True)
class Feed:
    """Items of stream ``stream`` for region item ``item`` (its consumer), from another
    region: ``pieces`` in order; ``finished``: the producer is done (no piece follows)."""

    item: int
    request: str
    stream: str
    pieces: tuple[Any, ...]
    finished: bool


@dataclass(frozen=True)
class Credit:
    """Region item ``item`` may commit items of channel ``channel`` up to ``items`` (its
    consumers' buffers are that full then): backpressure from region to region."""

    item: int
    request: str
    channel: str
    items: int


@dataclass(frozen=True)
class ConductorStats:
    """Counters since construction (steps) and a snapshot of what is held now."""

    speculated_steps: int  # iterations started before the previous stop was known
    wasted_steps: int  # speculative iterations discarded after dispatching work
    live_requests: int
    in_flight: int  # items queued or returned by ready(), not yet completed
    buffered_stream_items: int
    live_values: int
    live_values_by_request: Mapping[str, int]
    deferred_items: int = 0  # items a runner sent back to be run later (``defer``)
